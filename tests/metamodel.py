"""Validating what the server sends against spec/metaModel.json.

    from metamodel import MetaModel, validate_outgoing
    problems = MODEL.problems(message, method_for_id, token_owner)   # [] when valid
    validate_outgoing(message, method_for_id, token_owner)           # raises MetaModelError

`method_for_id` tells which method a request id belonged to (a mapping or a callable; None for
ids the client never sent). `token_owner` tells, for a `$/progress` token, which request method
it was sent with and whether it was its "partialResult" or its "workDone" token (a mapping or a
callable returning `(method, kind)` or None).

Structures are closed: a member the model does not list is an error, except in structures marked
`"open": true` and in the LSPAny/LSPObject aliases. Base types follow LSP's names, except that
`integer` is any JSON integer and `uinteger` any non-negative one (sizes and seeds pass 2^31).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping

SPEC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec")
META_MODEL_PATH = os.path.join(SPEC_DIR, "metaModel.json")
SCHEMA_PATH = os.path.join(SPEC_DIR, "metaModel.schema.json")

_RESPONSE_KEYS = ({"jsonrpc", "id", "result"}, {"jsonrpc", "id", "error"})


class MetaModelError(AssertionError):
    """A message that does not match the meta model."""


def _lookup(source, key):
    if source is None:
        return None
    if callable(source):
        return source(key)
    try:
        return source.get(key)
    except TypeError:  # unhashable key
        return None


def _short(value, limit=120) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MetaModel:
    def __init__(self, model: dict):
        self.model = model
        self.requests = {r["method"]: r for r in model["requests"]}
        self.notifications = {n["method"]: n for n in model["notifications"]}
        self.structures = {s["name"]: s for s in model["structures"]}
        self.enumerations = {e["name"]: e for e in model["enumerations"]}
        self.aliases = {a["name"]: a for a in model["typeAliases"]}
        self._props_cache: dict[str, tuple[dict, bool]] = {}
        self.error_codes = {v["value"] for v in self.enumerations["ErrorCodes"]["values"]}

    @classmethod
    def load(cls, path: str = META_MODEL_PATH) -> MetaModel:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    # -- consistency of the model itself ----------------------------------------------------
    def check_references(self) -> list[str]:
        """Names referenced but not defined, and definitions with duplicate names."""
        problems = []
        names = (
            [s["name"] for s in self.model["structures"]]
            + [e["name"] for e in self.model["enumerations"]]
            + [a["name"] for a in self.model["typeAliases"]]
        )
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"defined twice: {dupes}")

        def walk(t, where):
            if isinstance(t, list):
                for x in t:
                    walk(x, where)
                return
            if not isinstance(t, dict):
                return
            if t.get("kind") == "reference" and t.get("name") not in set(names):
                problems.append(f"{where}: unknown reference {t.get('name')!r}")
            for v in t.values():
                walk(v, where)

        for r in self.model["requests"]:
            walk(r, r["method"])
        for n in self.model["notifications"]:
            walk(n, n["method"])
        for s in self.model["structures"]:
            walk(s, s["name"])
        for a in self.model["typeAliases"]:
            walk(a, a["name"])
        return problems

    # -- types ------------------------------------------------------------------------------
    def _properties(self, name: str) -> tuple[dict, bool]:
        """All properties of a structure (its own, its extends' and mixins'), and whether it is open."""
        cached = self._props_cache.get(name)
        if cached is not None:
            return cached
        s = self.structures[name]
        props: dict = {}
        is_open = bool(s.get("open"))
        for parent in list(s.get("extends", [])) + list(s.get("mixins", [])):
            inherited, parent_open = self._properties(parent["name"])
            props.update(inherited)
            is_open = is_open or parent_open
        for p in s["properties"]:
            props[p["name"]] = p
        self._props_cache[name] = (props, is_open)
        return props, is_open

    def check(self, value, type_: dict, path: str = "$") -> list[str]:
        """Problems of `value` against a metaModel type; [] when it matches."""
        kind = type_["kind"]
        if kind == "base":
            return self._check_base(value, type_["name"], path)
        if kind == "reference":
            return self._check_reference(value, type_["name"], path)
        if kind == "array":
            if not isinstance(value, list):
                return [f"{path}: expected an array, got {_short(value)}"]
            out = []
            for i, item in enumerate(value):
                out += self.check(item, type_["element"], f"{path}[{i}]")
            return out
        if kind == "map":
            if not isinstance(value, dict):
                return [f"{path}: expected an object (map), got {_short(value)}"]
            out = []
            for k, v in value.items():
                out += self.check(k, type_["key"], f"{path}.<key {k!r}>")
                out += self.check(v, type_["value"], f"{path}.{k}")
            return out
        if kind == "or":
            attempts = []
            for item in type_["items"]:
                problems = self.check(value, item, path)
                if not problems:
                    return []
                attempts.append(problems)
            best = min(attempts, key=len)
            return [f"{path}: {_short(value)} matches none of {self._describe(type_)}; closest: {'; '.join(best[:3])}"]
        if kind == "and":
            out = []
            for item in type_["items"]:
                out += self.check(value, item, path)
            return out
        if kind == "tuple":
            items = type_["items"]
            if not isinstance(value, list) or len(value) != len(items):
                return [f"{path}: expected a tuple of {len(items)}, got {_short(value)}"]
            out = []
            for i, (v, t) in enumerate(zip(value, items)):
                out += self.check(v, t, f"{path}[{i}]")
            return out
        if kind == "literal":
            return self._check_structure(
                value,
                {p["name"]: p for p in type_["value"]["properties"]},
                bool(type_["value"].get("open")),
                path,
                "literal",
            )
        if kind == "stringLiteral":
            return (
                []
                if value == type_["value"] and isinstance(value, str)
                else [f"{path}: expected {type_['value']!r}, got {_short(value)}"]
            )
        if kind == "integerLiteral":
            ok = isinstance(value, int) and not isinstance(value, bool) and value == type_["value"]
            return [] if ok else [f"{path}: expected {type_['value']}, got {_short(value)}"]
        if kind == "booleanLiteral":
            return [] if value is type_["value"] else [f"{path}: expected {type_['value']}, got {_short(value)}"]
        return [f"{path}: the meta model uses an unknown type kind {kind!r}"]

    def _describe(self, type_) -> str:
        kind = type_["kind"]
        if kind in ("base", "reference"):
            return type_["name"]
        if kind == "array":
            return self._describe(type_["element"]) + "[]"
        if kind == "or":
            return " | ".join(self._describe(t) for t in type_["items"])
        if kind.endswith("Literal"):
            return repr(type_["value"])
        return kind

    @staticmethod
    def _check_base(value, name, path) -> list[str]:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name == "string":
            ok = isinstance(value, str)
        elif name == "integer":
            ok = is_int
        elif name == "uinteger":
            ok = is_int and value >= 0
        elif name == "decimal":
            ok = (is_int or isinstance(value, float)) and not (isinstance(value, float) and not math.isfinite(value))
        elif name == "boolean":
            ok = isinstance(value, bool)
        elif name == "null":
            ok = value is None
        else:
            return [f"{path}: the meta model uses an unknown base type {name!r}"]
        return [] if ok else [f"{path}: expected {name}, got {_short(value)}"]

    def _check_reference(self, value, name, path) -> list[str]:
        if name in self.structures:
            props, is_open = self._properties(name)
            return self._check_structure(value, props, is_open, path, name)
        if name in self.enumerations:
            enum = self.enumerations[name]
            problems = self._check_base(value, enum["type"]["name"], path)
            if problems:
                return problems
            values = [v["value"] for v in enum["values"]]
            if value not in values and not enum.get("supportsCustomValues"):
                return [f"{path}: {_short(value)} is not a {name} ({values})"]
            return []
        if name in self.aliases:
            return self.check(value, self.aliases[name]["type"], path)
        return [f"{path}: the meta model has no type {name!r}"]

    def _check_structure(self, value, props: dict, is_open: bool, path: str, name: str) -> list[str]:
        if not isinstance(value, dict):
            return [f"{path}: expected a {name} object, got {_short(value)}"]
        out = []
        for pname, p in props.items():
            if pname not in value:
                if not p.get("optional"):
                    out.append(f"{path}: {name} lacks the required property {pname!r}")
                continue
            out += self.check(value[pname], p["type"], f"{path}.{pname}")
        if not is_open:
            extra = sorted(set(value) - set(props))
            if extra:
                out.append(f"{path}: {name} has properties the meta model does not list: {extra}")
        return out

    # -- messages ---------------------------------------------------------------------------
    def problems(self, message, method_for_id=None, token_owner=None) -> list[str]:
        """Everything wrong with one message the server sent."""
        if not isinstance(message, dict):
            return [f"a message must be a JSON object, got {_short(message)}"]
        out = []
        if message.get("jsonrpc") != "2.0":
            out.append(f'jsonrpc must be "2.0": {_short(message)}')
        if "method" in message:
            method = message["method"]
            if not isinstance(method, str):
                return out + [f"method must be a string: {_short(message)}"]
            if "id" in message:
                out += self._server_request(message)
            else:
                out += self._notification(message, method_for_id, token_owner)
            return out
        return out + self._response(message, method_for_id)

    def _server_request(self, message) -> list[str]:
        out = []
        extra = set(message) - {"jsonrpc", "id", "method", "params"}
        if extra:
            out.append(f"a request has unknown members {sorted(extra)}")
        rid = message["id"]
        if isinstance(rid, bool) or not isinstance(rid, (int, str)):
            out.append(f"a server request's id must be an integer or a string, got {_short(rid)}")
        spec = self.requests.get(message["method"])
        if spec is None or spec["messageDirection"] not in ("serverToClient", "both"):
            return out + [f"the server sent request {message['method']!r}, which the meta model does not let it send"]
        return out + self._params(message, spec)

    def _params(self, message, spec) -> list[str]:
        where = f"{message['method']} params"
        if "params" not in spec:
            if message.get("params") not in (None, {}, []):
                return [f"{where}: the meta model lists no params, got {_short(message['params'])}"]
            return []
        if "params" not in message:
            return [f"{where}: missing"]
        ptype = spec["params"]
        if isinstance(ptype, list):
            return self.check(message["params"], {"kind": "tuple", "items": ptype}, where)
        return self.check(message["params"], ptype, where)

    def _notification(self, message, method_for_id, token_owner) -> list[str]:
        out = []
        extra = set(message) - {"jsonrpc", "method", "params"}
        if extra:
            out.append(f"a notification has unknown members {sorted(extra)}")
        method = message["method"]
        spec = self.notifications.get(method)
        if spec is None or spec["messageDirection"] not in ("serverToClient", "both"):
            return out + [f"the server sent notification {method!r}, which the meta model does not let it send"]
        out += self._params(message, spec)
        if out or method != "$/progress":
            return out
        token, value = message["params"]["token"], message["params"]["value"]
        owner = _lookup(token_owner, token)
        if owner is None:
            return [f"$/progress for token {_short(token)}, which the client never sent"]
        owner_method, kind = owner
        where = f"$/progress value ({kind} of {owner_method})"
        if kind == "workDone":
            return self.check(
                value,
                {
                    "kind": "or",
                    "items": [
                        {"kind": "reference", "name": "WorkDoneProgressBegin"},
                        {"kind": "reference", "name": "WorkDoneProgressReport"},
                        {"kind": "reference", "name": "WorkDoneProgressEnd"},
                    ],
                },
                where,
            )
        spec = self.requests.get(owner_method)
        if spec is None or "partialResult" not in spec:
            return [f"{where}: {owner_method!r} has no partial result in the meta model"]
        return self.check(value, spec["partialResult"], where)

    def _response(self, message, method_for_id) -> list[str]:
        keys = set(message)
        if keys not in _RESPONSE_KEYS:
            return [f"a response must have exactly jsonrpc, id and one of result/error; got {sorted(keys)}"]
        rid = message["id"]
        if isinstance(rid, bool) or not (rid is None or isinstance(rid, (int, str))):
            return [f"a response id must be an integer, a string or null, got {_short(rid)}"]
        # JSON-RPC lets a request have id null (LSP does not); its response then has id null too.
        method = _lookup(method_for_id, rid)
        spec = self.requests.get(method) if method is not None else None
        if "result" in message:
            if method is None:
                return [f"a result for id {_short(rid)}, which the client never sent"]
            if spec is None:
                return [f"a result for {method!r}, a method the meta model does not have"]
            return self.check(message["result"], spec["result"], f"{method} result")
        error = message["error"]
        if not isinstance(error, dict):
            return [f"error must be an object, got {_short(error)}"]
        out = []
        extra = set(error) - {"code", "message", "data"}
        if extra:
            out.append(f"error has unknown members {sorted(extra)}")
        code = error.get("code")
        if isinstance(code, bool) or not isinstance(code, int):
            out.append(f"error.code must be an integer, got {_short(code)}")
        elif code not in self.error_codes:
            out.append(f"error.code {code} is not in the meta model's ErrorCodes")
        if not isinstance(error.get("message"), str):
            out.append(f"error.message must be a string, got {_short(error.get('message'))}")
        if "data" in error:
            if spec is not None and "errorData" in spec:
                out += self.check(error["data"], spec["errorData"], f"{method} error.data")
            else:
                # Ids of unknown methods, ids never sent, id null: only generic data.
                out += self.check(
                    error["data"],
                    {"kind": "or", "items": [{"kind": "base", "name": "null"}, {"kind": "base", "name": "string"}]},
                    "error.data",
                )
        return out


_MODEL: MetaModel | None = None


def model() -> MetaModel:
    """The meta model of spec/metaModel.json, loaded once."""
    global _MODEL
    if _MODEL is None:
        _MODEL = MetaModel.load()
    return _MODEL


def validate_outgoing(
    message, request_method_for_id: Mapping | Callable | None = None, token_owner: Mapping | Callable | None = None
) -> None:
    """Raise MetaModelError when a message the server sent does not match the meta model."""
    problems = model().problems(message, request_method_for_id, token_owner)
    if problems:
        raise MetaModelError("; ".join(problems) + f"\n  message: {_short(message, 600)}")
