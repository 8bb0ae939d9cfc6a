"""The protocol's own params: a chat's messages and tools, a prompt's token ids, an infill's extra
files. Option objects are read by kinfer_rpc.protocol.options."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from typing import Any

from kinfer_rpc import errors
from kinfer_rpc.host.options import check_text
from kinfer_rpc.host.tools import ToolChoice
from kinfer_rpc.protocol.fields import Fields


def messages(value: object, paths: bool = True) -> list[dict[str, Any]]:
    """A chat's messages, shaped for chat templates as Hugging Face and llama.cpp (--jinja) pass
    them. A plain message is {role, content}, as it always was. An assistant message with
    `toolCalls` gets `tool_calls`: [{id, type: "function", function: {name, arguments}}] with
    `arguments` a dict (llama.cpp's minja passes a dict too; templates write it with `| tojson`)
    and `content` "" when it had none. A tool's result {"role": "tool", content, toolCallId?,
    name?} gets `tool_call_id` and `name` (the name of the call it answers when not given). An
    assistant's `reasoning` (a thinking model's, as a result gave it) gets `reasoning_content`
    and `thinking`, the names templates read it by; the template keeps or drops it. A message's
    `images` (each base64, a data: URL, or with `paths` the absolute path of a file) become the
    files' bytes; the host puts them before the message's content."""
    if not isinstance(value, list) or not value:
        raise errors.invalid_params("messages must be a non-empty list of {role, content}")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # the calls made so far: id -> the function's name
    pending: list[str] = []  # names of the last assistant's calls not yet answered, in order
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise errors.invalid_params(f"{where} must be an object with string role and content")
        role = m["role"]
        check_text(role, f"{where}.role")
        calls = m.get("toolCalls")
        if calls == []:  # as OpenAI's clients send with no calls
            calls = None
        content = m.get("content")
        if calls is not None:
            if role != "assistant":
                raise _bad(f"{where}.toolCalls", "only on an assistant's message")
            if content is None:
                content = ""
        if not isinstance(content, str):
            raise errors.invalid_params(
                f"{where} must be an object with string role and content", {"field": f"{where}.content"}
            )
        check_text(content, f"{where}.content")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("images") is not None:
            msg["images"] = images(m["images"], f"{where}.images", paths)
        thought = m.get("reasoning")
        if thought is not None:
            if role != "assistant" or not isinstance(thought, str):
                raise _bad(f"{where}.reasoning", "a string, on an assistant's message")
            check_text(thought, f"{where}.reasoning")
            # as templates read it: Qwen3's and llama.cpp's reasoning_content, gpt-oss's thinking
            msg["reasoning_content"] = msg["thinking"] = thought
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{where}.toolCalls")
            pending = [c["function"]["name"] for c in msg["tool_calls"]]
            names.update((c["id"], c["function"]["name"]) for c in msg["tool_calls"])
        elif role == "tool":
            call_id = _opt_str(m, "toolCallId", where)
            name = _opt_str(m, "name", where)
            if name is None:
                name = names.get(call_id) if call_id is not None else (pending[0] if pending else None)
            if name in pending:
                pending.remove(name)
            if call_id is not None:
                msg["tool_call_id"] = call_id
            if name is not None:
                msg["name"] = name
        out.append(msg)
    return out


MAX_IMAGE_BYTES = 32 << 20  # the largest image file a message may carry


def images(value: object, field: str, paths: bool = True) -> list[bytes]:
    """A message's images as the bytes of their files: each a base64 string, a data: URL
    (base64), or where `paths` allows (the stdio and socket protocol, whose clients share this
    machine's files) the absolute path of a file (or a file: URL). What the bytes hold (PNG,
    JPEG, ...) is for the model's projector to read."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _bad(
            field,
            "a list of images (base64 strings"
            + (", data: URLs or absolute file paths)" if paths else " or data: URLs)"),
        )
    out = []
    for j, text in enumerate(value):
        at = f"{field}[{j}]"
        path = text[len("file://") :] if text.startswith("file://") else text
        if paths and os.path.isabs(path) and os.path.isfile(path):
            try:
                size = os.path.getsize(path)
                if size > MAX_IMAGE_BYTES:
                    raise errors.invalid_params(
                        f"{at}: {path} is {size} bytes, more than an image may be", {"field": at}
                    )
                with open(path, "rb") as fh:
                    out.append(fh.read())
            except OSError as exc:
                raise errors.invalid_params(f"{at}: {path} cannot be read: {exc.strerror}", {"field": at}) from None
            continue
        data = text
        if text.startswith("data:"):
            head, sep, data = text.partition(",")
            if not sep or not head.endswith(";base64"):
                raise _bad(at, "a base64 data: URL (data:image/png;base64,...)")
        if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise errors.invalid_params(f"{at} is larger than an image may be ({MAX_IMAGE_BYTES} bytes)", {"field": at})
        try:
            out.append(base64.b64decode(data.strip(), validate=True))
        except (binascii.Error, ValueError):
            where = ", a data: URL or an absolute path of a file" if paths else " or a data: URL"
            raise _bad(at, f"an image as base64{where}") from None
    return out


def _bad(field: str, what: str) -> errors.KinferError:
    return errors.invalid_params(f"{field} must be {what}", {"field": field})


def _opt_str(obj: dict[str, Any], key: str, where: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _bad(f"{where}.{key}", "a non-empty string")
    check_text(v, f"{where}.{key}")
    return v


def _check_json(value: object, field: str) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise errors.invalid_params(f"{field} is not valid Unicode (a lone surrogate?)", {"field": field}) from None
    except (ValueError, TypeError, RecursionError):
        raise _bad(field, "JSON") from None


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad(where, "a non-empty list of tool calls")
    out = []
    for j, c in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise _bad(at, 'an object {id?, type: "function", function: {name, arguments}}')
        call_id = _opt_str(c, "id", at)
        if c.get("type", "function") != "function":
            raise _bad(f"{at}.type", '"function"')
        fn = c.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", "an object {name, arguments}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{at}.function.name", "a non-empty string")
        check_text(name, f"{at}.function.name")
        args = fn.get("arguments")
        field = f"{at}.function.arguments"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise _bad(field, "a JSON object or a string of one") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise _bad(field, "a JSON object or a string of one")
        _check_json(args, field)
        out.append(
            {
                "id": call_id if call_id is not None else f"call_{j}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    return out


MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tools(value: object) -> list[dict[str, Any]]:
    """A chat's tools, as templates read them: [{"type": "function", "function": {name,
    description?, parameters?}}] (keys other than these are dropped). None is no tools."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("tools", 'a list of {type: "function", function: {name, description?, parameters?}}')
    if len(value) > MAX_TOOLS:
        raise errors.invalid_params(f"tools has {len(value)} tools, over the limit of {MAX_TOOLS}", {"field": "tools"})
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(at, 'an object {type: "function", function: {name, description?, parameters?}}')
        if t.get("type", "function") != "function":
            raise _bad(f"{at}.type", '"function"')
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{at}.function", "an object {name, description?, parameters?}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"{at}.function.name", "1 to 64 letters, digits, '_', '.' or '-'")
        if name in seen:
            raise errors.invalid_params(
                f"{at}.function.name: a second tool named {name!r}", {"field": f"{at}.function.name"}
            )
        seen.add(name)
        function: dict[str, Any] = {"name": name}
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise _bad(f"{at}.function.description", "a string")
            check_text(description, f"{at}.function.description")
            function["description"] = description
        parameters = fn.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _bad(f"{at}.function.parameters", "a JSON schema (an object)")
            _check_json(parameters, f"{at}.function.parameters")
            function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out


_CHOICES = {mode: ToolChoice(mode) for mode in ("auto", "none", "required")}


def tool_choice(value: object, tools: list[dict[str, Any]]) -> ToolChoice:
    """toolChoice: "auto" (the default with tools; "none" without), "none", "required", a
    function's name, or {"type": "function", "function": {"name"}}. The three words win over a
    tool of the same name; the object form names any tool."""
    names = [t["function"]["name"] for t in tools]
    if value is None:
        return ToolChoice("auto" if tools else "none")
    name: object
    if isinstance(value, str):
        if value in _CHOICES:
            if value == "required" and not tools:
                raise errors.invalid_params('toolChoice "required" needs tools', {"field": "toolChoice"})
            return _CHOICES[value]
        name = value
    elif isinstance(value, dict):
        fn = value.get("function")
        if value.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad("toolChoice", 'an object {type: "function", function: {name}}')
        name = fn.get("name")
        if not isinstance(name, str):
            raise _bad("toolChoice.function.name", "a string")
    else:
        raise _bad(
            "toolChoice", '"auto", "none", "required", a function\'s name or {type: "function", function: {name}}'
        )
    if name not in names:
        listing = ", ".join(names) if names else "none"
        raise errors.invalid_params(
            f"toolChoice names no tool of this request: {name!r}; the tools are: {listing}",
            {"field": "toolChoice", "available": names},
        )
    return ToolChoice("function", name)


def tokens(value: Any) -> tuple[int, ...]:
    """A prompt's token ids (whether the model has them, the host checks)."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.invalid_params("tokens must be a list of integers")
    return tuple(value)


MAX_EXTRA = 1024  # files an infill's extra context may name


def infill_extra(value: object) -> list[tuple[str, str]]:
    """An infill's `extra`: [{filename?, text}] as (filename, text) pairs ("tmp" for a file
    without a name, as llama.cpp's server names it)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise errors.invalid_params("params.extra must be a list of {filename, text}", {"field": "params.extra"})
    if len(value) > MAX_EXTRA:
        raise errors.invalid_params(f"params.extra: at most {MAX_EXTRA} files", {"field": "params.extra"})
    out = []
    for i, item in enumerate(value):
        f = Fields(item, f"params.extra[{i}]")
        name = f.str("filename", "tmp")
        text = f.str("text")
        f.done()
        if text is None:
            raise errors.invalid_params(f"params.extra[{i}].text is required", {"field": f"params.extra[{i}].text"})
        out.append((name, text))
    return out


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def keep_alive(value: object) -> float | None:
    """`keepAlive` as Ollama's keep_alive: seconds (a number), or a duration ("10m", "1h30m",
    "45s", "500ms"); 0 unloads the model as soon as it is idle, a negative value keeps it until
    it is unloaded (inf). None when not given."""
    where = "params.keepAlive"
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float("inf") if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and number == number:
            return float("inf") if number < 0 else number
        if text.startswith("-") and _all_durations(text[1:]):
            return float("inf")
        if _all_durations(text):
            return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))
    raise _bad(where, 'a number of seconds or a duration such as "5m", "1h30m" or "-1"')


def _all_durations(text: str) -> bool:
    return bool(text) and "".join(m.group(0) for m in _DURATION.finditer(text)) == text


def texts(value: object, field: str, one: bool = True) -> tuple[str, ...]:
    """`inference/embed`'s input (a string, or a list of strings when `one`) or `inference/rerank`'s
    documents (a list of strings)."""
    if one and isinstance(value, str):
        check_text(value, f"params.{field}")
        return (value,)
    what = "a string or a list of strings" if one else "a list of strings"
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise errors.invalid_params(f"params.{field} must be {what}", {"field": f"params.{field}"})
    for i, t in enumerate(value):
        check_text(t, f"params.{field}[{i}]")
    return tuple(value)
