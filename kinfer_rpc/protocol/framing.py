"""The LSP base protocol's framing: bytes <-> JSON messages. Knows nothing of methods.

A frame is `Content-Length: N\\r\\n`, optional `Content-Type: application/vscode-jsonrpc;
charset=utf-8\\r\\n`, a blank line, then N bytes of UTF-8 JSON. Bad input never stops the reader:
it yields a `FrameError` (with the message's id when the body told us one) and goes on with the
next frame, resynchronising on the next `Content-Length` header when the headers were broken.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any, Protocol

import attrs

from kinfer_rpc import errors

MAX_FRAME_BYTES = 64 * 1024 * 1024  # default limit of one frame's body
MAX_HEADER_BYTES = 8192
_HEADER_START = re.compile(rb"content-length\s*:", re.IGNORECASE)


@attrs.frozen
class FrameError:
    """A frame that could not become a message: answered if `id` is known, else logged."""

    code: int
    message: str
    id: object = None
    has_id: bool = False


def encode(message: dict[str, Any]) -> bytes:
    """One whole frame for a message."""
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed back from the client: escape it
        body = json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def _parse_body(body: bytes) -> dict[str, Any] | FrameError:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return FrameError(errors.PARSE_ERROR, f"the body is not UTF-8: {exc}")
    try:
        message = json.loads(text)
    except RecursionError:
        return _untaken(text, "the body nests JSON deeper than the server's parser takes (about 1,000 levels)")
    except ValueError as exc:
        if _TOO_MANY_DIGITS in str(exc):
            return _untaken(text, f"the body has a number literal the server's parser does not take: {exc}")
        return FrameError(errors.PARSE_ERROR, f"the body is not JSON: {exc}")
    if isinstance(message, list):
        return FrameError(errors.INVALID_REQUEST, "JSON-RPC batches are not supported (as in LSP)")
    if not isinstance(message, dict):
        return FrameError(errors.INVALID_REQUEST, "a message must be a JSON object")
    return message


# What Python's json says of an integer literal past sys.get_int_max_str_digits() (4,300 digits).
_TOO_MANY_DIGITS = "for integer string conversion"


def _untaken(text: str, why: str) -> FrameError:
    """A body json.loads could not take whole although it may well be JSON: a request's is
    answered with its id (read from the top level), so that the request does not wait forever."""
    members = top_level(text)
    rid = members.get("id", _UNREAD) if members is not None and "method" in members else _UNREAD
    if isinstance(rid, bool) or not isinstance(rid, (str, int, type(None))):
        return FrameError(errors.PARSE_ERROR, why)  # no id, or not one a request can have
    return FrameError(errors.PARSE_ERROR, why, rid, True)


_UNREAD = object()  # a member's value that json could not read alone
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# Inside a value to skip: strings whole (a bracket in one is a character), runs of opening or of
# closing brackets (a run of a thousand is one step).
_NESTED = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]+|[\]}]+')
_SKIP_STEPS = 1 << 20  # at most this many steps skipping values (about half a second): else unread
_DECODER = json.JSONDecoder()


def _ws(text: str, pos: int) -> int:
    """Where the white space at `pos` ends."""
    m = _WS.match(text, pos)
    return m.end() if m else pos


def top_level(text: str) -> dict[str, object] | None:
    """The members of the JSON object `text`, each value read alone by json, or _UNREAD where
    json cannot read it (nested too deeply, a number too long): such a value is skipped over by
    its brackets, never descended into. None when `text` is not an object as far as read."""
    pos = _ws(text, 0)
    if not text.startswith("{", pos):
        return None
    pos += 1
    members: dict[str, object] = {}
    steps = [_SKIP_STEPS]
    while True:
        pos = _ws(text, pos)
        if not text.startswith('"', pos):
            return None
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        pos = _ws(text, pos)
        if not text.startswith(":", pos):
            return None
        pos = _ws(text, pos + 1)
        try:
            members[key], pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            pos = _skip_value(text, pos, steps)
            if pos < 0:
                return None
            members[key] = _UNREAD
        pos = _ws(text, pos)
        if text.startswith(",", pos):
            pos += 1
        elif text.startswith("}", pos):
            return members
        else:
            return None


def _skip_value(text: str, pos: int, steps: list[int]) -> int:
    """Where the JSON value at `pos`, which json could not read, ends; -1 if nowhere."""
    if not text.startswith(("[", "{"), pos):
        number = _NUMBER.match(text, pos)  # a number too long for int()
        return number.end() if number else -1
    depth = 0
    for m in _NESTED.finditer(text, pos):
        steps[0] -= 1
        if steps[0] < 0:
            return -1
        run = m.group()
        if run[0] in "[{":
            depth += len(run)
        elif run[0] != '"':
            if len(run) >= depth:
                return m.start() + depth
            depth -= len(run)
    return -1


class FrameParser:
    """Frames out of bytes fed in any pieces, with no I/O of its own (the server's async reader
    and the Python client's blocking and async readers all use it).

    `feed(data)` adds bytes; `next()` gives the next message or FrameError, or None when it
    needs more bytes; `end()` says what the stream's end left unfinished, if anything."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._body: int | None = None  # the length of the body being read, its headers taken
        self._skip = 0  # bytes of a refused frame still to drop

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next(self) -> dict[str, Any] | FrameError | None:
        buf = self._buf
        while True:
            if self._skip:
                n = min(self._skip, len(buf))
                del buf[:n]
                self._skip -= n
                if self._skip:
                    return None
            if self._body is not None:
                if len(buf) < self._body:
                    return None
                body = bytes(buf[: self._body])
                del buf[: self._body]
                self._body = None
                return _parse_body(body)
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEADER_BYTES:
                    self._resync(1)
                    return FrameError(errors.PARSE_ERROR, "headers too long or missing the blank line")
                return None
            length, problem = _content_length(bytes(buf[:end]))
            if problem:
                if length is None:
                    # No length to trust: a Content-Length header later in this block may start
                    # a frame (garbage glued in front of it); else look after this block.
                    inner = _HEADER_START.search(buf, 1, end)
                    self._resync(inner.start() if inner else end + 4)
                else:  # the length is known: skip the refused frame whole, body included
                    del buf[: end + 4]
                    self._skip = length
                return FrameError(errors.PARSE_ERROR, problem)
            del buf[: end + 4]
            assert length is not None  # _content_length gives no problem only with a length
            if length > self.max_frame:
                self._skip = length
                return FrameError(
                    errors.INVALID_REQUEST, f"frame of {length} bytes is over the limit of {self.max_frame} bytes"
                )
            self._body = length

    def end(self) -> FrameError | None:
        """At the stream's end: what it cut short (call once next() gives None)."""
        if self._body is not None:
            return FrameError(errors.PARSE_ERROR, "the stream ended inside a frame's body")
        if not self._skip and self._buf.strip():
            return FrameError(errors.PARSE_ERROR, "the stream ended inside a frame's headers")
        return None

    def _resync(self, start: int) -> None:
        """Drop bytes up to the next Content-Length header at or after `start`.

        Without one, keep only a tail too short to hold a header's end, so the same broken
        block is never parsed twice and the next read brings new bytes."""
        m = _HEADER_START.search(self._buf, start)
        if m:
            del self._buf[: m.start()]
        else:
            del self._buf[: max(0, len(self._buf) - (len(b"content-length:") - 1))]
            end = self._buf.rfind(b"\r\n\r\n")
            if end >= 0:
                del self._buf[: end + 4]


class ByteSource(Protocol):
    """What FrameReader reads from: anything with `async receive() -> bytes`."""

    async def receive(self) -> bytes: ...


class FrameReader:
    """Reads frames from a byte stream (anything with `async receive() -> bytes`)."""

    def __init__(self, stream: ByteSource, max_frame: int = MAX_FRAME_BYTES):
        self._stream = stream
        self._parser = FrameParser(max_frame)

    @property
    def max_frame(self) -> int:
        return self._parser.max_frame

    async def __aiter__(self) -> AsyncIterator[dict[str, Any] | FrameError]:
        parser = self._parser
        while True:
            item = parser.next()
            if item is not None:
                yield item
                continue
            try:
                data = await self._stream.receive()
            except Exception:  # EndOfStream, ClosedResourceError, BrokenResourceError
                data = b""
            if not data:
                cut = parser.end()
                if cut is not None:
                    yield cut
                return
            parser.feed(data)


# A petabyte: lengths past it are garbage, not frames to skip (and past 4,300 digits int() refuses).
_LENGTH_DIGITS = 15


def _content_length(headers: bytes) -> tuple[int | None, str | None]:
    """The body's length (None if unknown) and what was wrong with the headers, if anything."""
    length = None
    problem = None
    try:
        text = headers.decode("ascii")
    except UnicodeDecodeError:
        return None, "headers are not ASCII"
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        if not sep:
            return None, f"malformed header line {line[:80]!r}"
        name, value = name.strip().lower(), value.strip()
        if name == "content-length":
            if not (value.isascii() and value.isdigit()):
                return None, f"Content-Length is not a number: {value[:40]!r}"
            if len(value.lstrip("0")) > _LENGTH_DIGITS:  # no frame is that long: malformed, resync
                return None, f"Content-Length has {len(value)} digits: {value[:20]}..."
            length = int(value)
        elif name == "content-type":
            charset = re.search(r"charset\s*=\s*([^;\s]+)", value, re.IGNORECASE)
            if charset and charset.group(1).strip("'\"").lower() not in ("utf-8", "utf8"):
                problem = f"unsupported charset {charset.group(1)!r} (only utf-8)"
    if length is None:
        return None, "missing Content-Length header"
    return length, problem
