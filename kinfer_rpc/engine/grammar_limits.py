"""How large and how deep a request's schema, grammar, regex or tools may be, checked before
llguidance sees them.

llguidance compiles a rule that refers to a rule, a terminal built of terminals and a schema
whose `$ref` leads to another by recursion on the compiling thread's stack: about 3 kB a rule of
a chain, 2 kB a group in a group, 9 kB a `$ref` (llguidance 1.9). With no bound, 4,000 chained
rules overflow a thread's usual 8 MiB and end the process. So grammars compile on a thread of
their own with COMPILE_STACK bytes of stack (kinfer_rpc.engine.grammar), and these limits keep
the deepest input they let through under half of it: 128 KiB of grammar built to recurse as deep
as it can (rules of groups nested 24 deep, each referring to the next) takes 98 MiB.

The limits are far above real inputs (a Lark grammar of a programming language has a few hundred
rules; a schema of 5,000 properties compiles in a quarter of a second), and each nesting limit is
under the one llguidance's own parser enforces, so that the refusal names ours. Exceeding one is
-32602 naming the limit, `data` `{field, error, limit, max}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kinfer_rpc import errors

COMPILE_STACK = 256 << 20  # stack of the thread a compile runs on (only what it touches is ever used)

MAX_TEXT_BYTES = 128 << 10  # a grammar's or a regex's text, in UTF-8
MAX_RULES = 10_000  # a grammar's rules and terminals
MAX_GROUP_NESTING = 24  # groups in groups within one rule: llguidance's Lark parser stops at 28
MAX_REGEX_NESTING = 100  # groups in groups of a regex: llguidance's regex parser stops at 250
MAX_SCHEMA_BYTES = 1 << 20  # a schema's JSON text; all of a request's tools' `parameters` together
MAX_SCHEMAS = 10_000  # JSON objects in a schema, each a schema or a map of them; the tools' together
MAX_SCHEMA_NESTING = 64  # objects and arrays within each other: llguidance's JSON parser stops at 128


def refused(field: str, limit: str, maximum: int, error: str) -> errors.KinferError:
    """-32602 for a constraint over one of the limits; `error` says which, after the field's name."""
    return errors.invalid_params(f"{field} {error}", {"field": field, "error": error, "limit": limit, "max": maximum})


def check(kind: str, source: Any, field: str) -> None:
    """-32602 when a request's `format` (a schema as JSON text, or "json"), `grammar` or `regex`
    is over a limit. The grammar of forced tool calls is checked by check_tools instead."""
    if kind == "format":
        if source != "json":
            check_schemas([source if isinstance(source, str) else json.dumps(source)], field)
    elif kind == "regex":
        _check_size(source, field)
        _check_regex(source, field)
    elif kind == "grammar":
        _check_size(source, field)
        _check_grammar(source, field)


def check_tools(functions: Sequence[Mapping[str, Any]]) -> None:
    """-32602 (`field` "tools") when the `parameters` schemas of the tools a reply is forced to
    call are over the schema limits, all of them together."""
    try:
        texts = [json.dumps(f["parameters"]) for f in functions if f.get("parameters") is not None]
    except RecursionError:  # nested far deeper than the limit
        raise _too_deep("tools") from None
    check_schemas(texts, "tools")


def check_schemas(texts: Sequence[str], field: str) -> None:
    """The schema limits over `texts` (schemas as JSON text): their size and number of objects
    together, each one's nesting."""
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > MAX_SCHEMA_BYTES:
        error = f"is {size:,} bytes of JSON schema, over the limit of {MAX_SCHEMA_BYTES:,}"
        raise refused(field, "bytes", MAX_SCHEMA_BYTES, error)
    objects = 0
    for text in texts:
        try:
            value = json.loads(text)
        except RecursionError:  # nested far deeper than the limit
            raise _too_deep(field) from None
        except ValueError:
            continue  # not JSON: llguidance says why
        objects += _count_schemas(value, field, MAX_SCHEMAS - objects)


def _too_deep(field: str, what: str = "") -> errors.KinferError:
    error = f"{what}nests objects and arrays more than {MAX_SCHEMA_NESTING} deep, the limit"
    return refused(field, "nesting", MAX_SCHEMA_NESTING, error)


def _count_schemas(value: object, field: str, budget: int, what: str = "") -> int:
    """The JSON objects in `value`, at most `budget` of them, its nesting checked; iterative, as a
    schema may nest deeper than Python's recursion allows."""
    objects = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_SCHEMA_NESTING:
            raise _too_deep(field, what)
        if isinstance(item, dict):
            objects += 1
            if objects > budget:
                error = f"{what}has more than {MAX_SCHEMAS:,} schemas (JSON objects), the limit"
                raise refused(field, "schemas", MAX_SCHEMAS, error)
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return objects


def _check_size(text: str, field: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise refused(field, "bytes", MAX_TEXT_BYTES, f"is {size:,} bytes, over the limit of {MAX_TEXT_BYTES:,}")


# A regex's groups: escapes and character classes (where a parenthesis is a character) are
# matched whole, so that only a group's own parentheses are left to count.
_REGEX_PART = re.compile(r"\\.|\[\^?\]?(?:\\.|\[:[a-z]+:\]|[^\]\\])*\]|[()]", re.DOTALL)


def _check_regex(text: str, field: str, what: str = "") -> None:
    depth = deepest = 0
    for m in _REGEX_PART.finditer(text):
        part = m.group()
        if part == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif part == ")":
            depth = max(0, depth - 1)
    if deepest > MAX_REGEX_NESTING:
        error = f"{what}nests groups {deepest} deep, over the limit of {MAX_REGEX_NESTING}"
        raise refused(field, "nesting", MAX_REGEX_NESTING, error)


# llguidance's Lark lexemes that hold other text: comments, strings, special tokens, /regex/
# terminals, and the JSON value after %json, %regex or %llguidance (which json's decoder reads
# from where it starts); a name and a colon at the start of a line define a rule or a terminal.
_LARK_PART = re.compile(
    r"""(?P<skip>(?:\#|//)[^\n]*|"(?:\\.|[^"\\\n])*"i?|<[^<>\s]+>)
    |(?P<regex>/(?:\\.|[^/\\])+/[imslux]*)
    |(?P<json>%(?:json|regex|llguidance)\b\s*)
    |(?P<open>[(\[])|(?P<close>[)\]])
    |\n[ \t]*(?P<name>[!?_]*[A-Za-z][A-Za-z0-9_\-]*(?:\.-?[0-9]+)?[ \t]*:)?""",
    re.VERBOSE,
)
_JSON = json.JSONDecoder()


def _check_grammar(text: str, field: str) -> None:
    """A Lark grammar's rules and terminals, its groups' nesting within a rule, its /regex/
    terminals as regexes and its %json schemas as schemas (their objects counted together)."""
    rules = depth = objects = 0
    text = "\n" + text  # the first line starts a line too
    pos = 0
    while (m := _LARK_PART.search(text, pos)) is not None:
        pos = m.end()
        kind = m.lastgroup
        if kind == "regex":
            _check_regex(m.group(), field, "has a /regex/ terminal that ")
        elif kind == "json":
            try:
                value, end = _JSON.raw_decode(text, pos)
            except RecursionError:
                raise _too_deep(field, "has a %json schema that ") from None
            except ValueError:
                continue  # llguidance says what is wrong with it
            if m.group().startswith("%json"):
                objects += _count_schemas(value, field, MAX_SCHEMAS - objects, "has %json schemas that ")
            pos = end
        elif kind == "open":
            depth += 1
            if depth > MAX_GROUP_NESTING:
                error = f"nests groups more than {MAX_GROUP_NESTING} deep, the limit"
                raise refused(field, "nesting", MAX_GROUP_NESTING, error)
        elif kind == "close":
            depth = max(0, depth - 1)
        elif m.group("name"):
            rules += 1
            depth = 0
    if rules > MAX_RULES:
        error = f"has {rules:,} rules and terminals, over the limit of {MAX_RULES:,}"
        raise refused(field, "rules", MAX_RULES, error)
