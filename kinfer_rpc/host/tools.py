"""Tool calls on the host's side: which call syntax a chat template teaches, finding the calls in a
reply (whole or streamed), and the grammar that forces a reply made of calls.

A model calls a tool by writing text its chat template taught it; four syntaxes are known here:

- "hermes" (Hermes 2 Pro, Qwen 2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block a call, blocks one after another;
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and the newer
  `[TOOL_CALLS]name[ARGS]{...}` (one call a marker);
- "llama3" (Llama 3.1-3.3): a bare JSON object `{"name": ..., "parameters": {...}}`, or one after
  `<|python_tag|>`;
- "json" (any other template): a JSON object {"name", "arguments"}, or a list of them, as the whole
  reply or inside a ```json fence.

Parsing never raises on the model's output: what is not a well-formed call of a known tool stays
in the reply's text. Calls come out in the protocol's ToolCall shape,
{"id": "call_<i>", "type": "function", "function": {"name": str, "arguments": dict}}, numbered
from 0 in the reply.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import attrs

from kinfer_rpc.engine import grammar_limits

FORMATS = ("hermes", "mistral", "llama3", "json")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA3_MARKER = "<|python_tag|>"
MARKERS = (HERMES_OPEN, HERMES_CLOSE, MISTRAL_MARKER)  # what call_grammar may name as special tokens

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_SEP = _WS + ";,"  # between two calls written one after another
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})
_WRAPPED_KEYS = frozenset({"function", "id", "type"})
# Mistral's newer syntax: [TOOL_CALLS]name[ARGS]{...} or [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9_-]*)?\[ARGS\]\s*")
_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.DOTALL)
_TOOLS_WORD = re.compile(r"\btools\b")


@attrs.frozen
class ToolChoice:
    """A request's toolChoice: "auto", "none", "required", or "function" with the function's name."""

    mode: Literal["auto", "none", "required", "function"]
    name: str | None = None


def template_supports_tools(template: str | None) -> bool:
    """Whether the chat template renders `tools` at all (its source mentions the variable). A
    template that never reads it would drop the tools silently. None (no template of the model's
    own: ChatML, kinfer_rpc.host.templates.CHATML) does not."""
    return template is not None and _TOOLS_WORD.search(template) is not None


def call_format(template: str | None) -> str:
    """The call syntax the template teaches: "hermes", "mistral", "llama3" or "json" (see the
    module's doc)."""
    if not template:
        return "json"
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if LLAMA3_MARKER in template or "ipython" in template:
        return "llama3"
    return "json"


# --- parsing ---------------------------------------------------------------------------------------


def _one_call(obj: object, names: Collection[str]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) when `obj` is a call of a known tool, else None."""
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict) and obj.keys() <= _WRAPPED_KEYS and obj.get("type", "function") == "function":
        obj = fn  # OpenAI's own shape: {"type": "function", "function": {"name", "arguments"}}
    if not obj.keys() <= _CALL_KEYS or ("arguments" in obj and "parameters" in obj):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return name, args


def _value_calls(value: object, names: Collection[str]) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls in one JSON value: a call, or a non-empty list of nothing but calls."""
    if isinstance(value, list):
        calls = [_one_call(v, names) for v in value]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]
    call = _one_call(value, names)
    return None if call is None else [call]


def _skip(text: str, pos: int, chars: str) -> int:
    n = len(text)
    while pos < n and text[pos] in chars:
        pos += 1
    return pos


def _decode(text: str, pos: int) -> tuple[object, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # ValueError also for ints past Python's digit limit
        return None


def _sequence(text: str, names: Collection[str]) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls when `text` is nothing but one or more JSON calls (or lists of calls), separated
    by white space, `;` or `,`; else None."""
    calls: list[tuple[str, dict[str, Any]]] = []
    pos, n = _skip(text, 0, _WS), len(text)
    while pos < n:
        if text[pos] not in "[{":
            return None
        got = _decode(text, pos)
        if got is None:
            return None
        value, pos = got
        found = _value_calls(value, names)
        if found is None:
            return None
        calls += found
        pos = _skip(text, pos, _SEP)
    return calls or None


def _json_calls(text: str, names: Collection[str]) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[int, int]]]:
    """The generic syntax: the whole reply is calls, else every ```json fence that holds nothing
    but calls. Returns the calls and the spans of text they replace."""
    calls = _sequence(text, names)
    if calls:
        return calls, [(0, len(text))]
    found: list[tuple[str, dict[str, Any]]] = []
    spans: list[tuple[int, int]] = []
    for m in _FENCE.finditer(text):
        got = _sequence(m.group(1), names)
        if got:
            found += got
            spans.append(m.span())
    return found, spans


def _content(text: str, spans: list[tuple[int, int]]) -> str:
    if not spans:
        return text
    pieces, pos = [], 0
    for a, b in spans:
        pieces.append(text[pos:a])
        pos = b
    pieces.append(text[pos:])
    return "".join(pieces).strip()


class _Scanner:
    """Finds the calls of one format's markup in a growing text, left to right. advance(text,
    final=False) takes only calls that no continuation of `text` can change, so the calls a stream
    gives are always the first ones the whole text gives; final=True reads the text as complete."""

    def __init__(self, fmt: str, names: Collection[str]):
        self.fmt = fmt
        self.names = names
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.spans: list[tuple[int, int]] = []  # markup taken out of the content
        self.scan = 0  # where the next marker is looked for
        # inside a marker's calls (mistral, llama3): where the marker began, where its next value
        # begins, whether one call was read, and how long the text was when a value did not decode
        self.seg: int | None = None
        self.vpos = 0
        self.seg_end = 0
        self.tried = -1

    def advance(self, text: str, final: bool) -> None:
        if self.fmt == "hermes":
            self._hermes(text, final)
        elif self.fmt == "mistral":
            self._marked(text, MISTRAL_MARKER, final)
        elif self.fmt == "llama3":
            self._marked(text, LLAMA3_MARKER, final)

    def _hermes(self, text: str, final: bool) -> None:
        while True:
            i = text.find(HERMES_OPEN, self.scan)
            if i < 0:
                if not final:  # a marker may be cut at the end
                    self.scan = max(self.scan, len(text) - len(HERMES_OPEN) + 1)
                return
            body = i + len(HERMES_OPEN)
            close = text.find(HERMES_CLOSE, body)
            reopen = text.find(HERMES_OPEN, body)
            if close >= 0 and (reopen < 0 or close < reopen):
                end, after = close, close + len(HERMES_CLOSE)
            elif reopen >= 0:  # a block left open: the next one ends it
                end = after = reopen
            elif final:
                end = after = len(text)
            else:
                self.scan = i
                return
            got = _sequence(text[body:end], self.names)
            if got:
                self.calls += got
                self.spans.append((i, after))
            self.scan = after

    def _marked(self, text: str, marker: str, final: bool) -> None:
        while True:
            if self.seg is None:
                i = text.find(marker, self.scan)
                if i < 0:
                    if not final:
                        self.scan = max(self.scan, len(text) - len(marker) + 1)
                    return
                self.seg = i
                self.vpos = self.seg_end = i + len(marker)
                self.tried = -1
            first = self.seg_end == self.seg + len(marker)
            pos = _skip(text, self.vpos, _WS if first else _SEP)
            state = self._value(text, pos, first, marker, final)
            if state == "wait":
                return
            if state == "end":
                if self.seg_end > self.seg + len(marker):
                    self.spans.append((self.seg, self.seg_end))
                    self.scan = self.seg_end
                else:
                    self.scan = self.seg + len(marker)
                self.seg = None

    def _value(self, text: str, pos: int, first: bool, marker: str, final: bool) -> str:
        """Reads the value at `pos` of a marker's calls: "took" one, "wait" for more text, or "end"."""
        if pos >= len(text):
            return "end" if final else "wait"
        if text.startswith(marker, pos):  # the next marker ("[TOOL_CALLS]" is no JSON list)
            return "end"
        if not final and marker.startswith(text[pos:]):
            return "wait"
        start = pos
        if text[pos] not in "[{":
            if not (first and marker == MISTRAL_MARKER):
                return "end"
            brace = text.find("{", pos)
            if brace < 0:
                return "end" if final else "wait"
            m = _MISTRAL_NAMED.fullmatch(text, pos, brace)
            if m is None or m.group(1) not in self.names:
                return "end"
            pos = brace
        if not final and self.tried >= 0:
            if "}" not in text[self.tried :] and "]" not in text[self.tried :]:
                return "wait"  # a JSON value can only end on a closing bracket
        got = _decode(text, pos)
        if got is None:
            if final:
                return "end"
            self.tried = len(text)
            return "wait"
        self.tried = -1
        value, end = got
        if pos != start:  # [TOOL_CALLS]name[ARGS]{...}
            if not isinstance(value, dict):
                return "end"
            m = _MISTRAL_NAMED.fullmatch(text, start, pos)
            assert m is not None
            found = _value_calls({"name": m.group(1), "arguments": value}, self.names)
        else:
            found = _value_calls(value, self.names)
        if found is None:
            return "end"
        self.calls += found
        self.vpos = self.seg_end = end
        return "took"


def _shaped(calls: list[tuple[str, dict[str, Any]]], first: int = 0) -> list[dict[str, Any]]:
    return [
        {"id": f"call_{first + i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)
    ]


def parse_calls(text: str, fmt: str, tool_names: Collection[str]) -> tuple[str, list[dict[str, Any]]]:
    """The reply's content without the call markup, and its calls of the tools `tool_names`
    (ToolCall shape). Markup that is not a well-formed call of a known tool stays in the content.
    When the format's markup holds no call, the generic "json" syntax is tried on the whole reply.
    With calls, the content is stripped of white space around it; without, it is `text` as is."""
    scanner = _Scanner(fmt, tool_names)
    scanner.advance(text, final=True)
    calls, spans = scanner.calls, scanner.spans
    if not calls:
        calls, spans = _json_calls(text, tool_names)
    return _content(text, spans), _shaped(calls)


class CallStream:
    """parse_calls for a reply that arrives in pieces: feed() gives the calls that a piece
    completed, finish() the rest, so that together they are exactly parse_calls' calls for the
    whole text (same order, same ids).

    A call is given as soon as nothing after it can change it: a Hermes block at its
    `</tool_call>` (or the next `<tool_call>`), a Mistral/Llama value when its JSON closes. Calls
    found only by reading the reply as a whole come at finish(): the generic JSON syntax (a bare
    JSON reply, the Llama 3.2 style, ```json fences) and a last block the reply leaves open."""

    def __init__(self, fmt: str, tool_names: Collection[str]):
        self._text = ""
        self._names = tool_names
        self._scanner = _Scanner(fmt, tool_names)
        self._given = 0
        self._finished = False

    @property
    def text(self) -> str:
        return self._text

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self._finished:
            raise RuntimeError("CallStream.feed after finish")
        if not piece:
            return []
        self._text += piece
        self._scanner.advance(self._text, final=False)
        return self._take(self._scanner.calls)

    def finish(self) -> list[dict[str, Any]]:
        if self._finished:
            return []
        self._finished = True
        self._scanner.advance(self._text, final=True)
        calls = self._scanner.calls
        if not calls:
            calls, _ = _json_calls(self._text, self._names)
        return self._take(calls)

    def _take(self, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        new = _shaped(calls[self._given :], self._given)
        self._given = len(calls)
        return new


# --- grammar -----------------------------------------------------------------------------------------

# The JSON of a call's arguments is written as the templates write it (Python's json.dumps, which
# the models were trained on): ", " and ": " between items, no other white space. Flexible white
# space would let a small model pad forever.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    return json.dumps(text)


def _marker(text: str, special: Mapping[str, int] | None) -> str:
    """A marker as the grammar writes it: the special token when the vocabulary has it as one (a
    special token is not spelt by its text's bytes), else the text."""
    if special and text in special:
        return f"<[{int(special[text])}]>"
    return _lit(text)


def _args_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    schema = dict(params) if isinstance(params, Mapping) and params else {"type": "object"}
    if "type" not in schema and "properties" in schema:
        schema["type"] = "object"
    style = schema.get("x-guidance")
    schema["x-guidance"] = {**_JSON_STYLE, **(style if isinstance(style, Mapping) else {})}
    return schema


def call_grammar(
    tools: Sequence[Mapping[str, Any]],
    choice: ToolChoice,
    fmt: str,
    *,
    parallel: bool = True,
    special: Mapping[str, int] | None = None,
) -> str:
    """A grammar in llguidance's Lark syntax for a reply that is nothing but calls in format `fmt`:
    one or more (one when not `parallel`) of any tool (choice "required") or of the named one
    (choice "function"), each call's arguments held to its tool's `parameters` schema.

    `tools` is the request's tools as kinfer_rpc.protocol.params.tools returns them
    ({"type": "function", "function": {"name", "parameters"?}}). `special` maps a marker
    ("<tool_call>", "</tool_call>", "[TOOL_CALLS]") to its token id where the model's vocabulary
    has it as a special token. Raises ValueError for a choice that forces nothing ("auto", "none")
    or an unknown name, -32602 (`field` "tools") for parameters schemas over the limits of
    kinfer_rpc.engine.grammar_limits (all of them together). A parameters schema llguidance
    cannot compile makes the grammar fail to compile (LLMatcher.validate_grammar says why)."""
    functions = [t["function"] for t in tools]
    if choice.mode == "function":
        functions = [f for f in functions if f["name"] == choice.name]
        if not functions:
            raise ValueError(f"no tool named {choice.name!r}")
    elif choice.mode != "required":
        raise ValueError(f"toolChoice {choice.mode!r} forces no call")
    if not functions:
        raise ValueError("no tools to call")
    grammar_limits.check_tools(functions)
    key = "parameters" if fmt == "llama3" else "arguments"
    rules = ["%llguidance {}", "call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        head = f'{{"name": "{f["name"]}", "{key}": '
        rules.append(f'fn_{i}: {_lit(head)} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(_args_schema(f), ensure_ascii=False)}")
    more = parallel
    if fmt == "hermes":
        block = f'{_marker(HERMES_OPEN, special)} "\\n" call "\\n" {_marker(HERMES_CLOSE, special)}'
        start = f'start: block ("\\n" block)*\nblock: {block}' if more else f"start: {block}"
    elif fmt == "mistral":
        calls = 'call (", " call)*' if more else "call"
        start = f'start: {_marker(MISTRAL_MARKER, special)} "[" {calls} "]"'
    elif fmt == "llama3":
        start = 'start: call ("; " call)*' if more else "start: call"
    else:
        start = 'start: call | "[" call (", " call)* "]"' if more else "start: call"
    return "\n".join([rules[0], start, *rules[1:]]) + "\n"
