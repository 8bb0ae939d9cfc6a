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
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long integer literals
        return FrameError(errors.PARSE_ERROR, f"the body is not JSON: {exc}")
    if isinstance(message, list):
        return FrameError(errors.INVALID_REQUEST, "JSON-RPC batches are not supported (as in LSP)")
    if not isinstance(message, dict):
        return FrameError(errors.INVALID_REQUEST, "a message must be a JSON object")
    return message


class ByteSource(Protocol):
    """What FrameReader reads from: anything with `async receive() -> bytes`."""

    async def receive(self) -> bytes: ...


class FrameReader:
    """Reads frames from a byte stream (anything with `async receive() -> bytes`)."""

    def __init__(self, stream: ByteSource, max_frame: int = MAX_FRAME_BYTES):
        self._stream = stream
        self._buf = bytearray()
        self.max_frame = max_frame
        self._eof = False

    async def _fill(self) -> bool:
        if self._eof:
            return False
        try:
            data = await self._stream.receive()
        except Exception:  # EndOfStream, ClosedResourceError, BrokenResourceError
            data = b""
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

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

    async def __aiter__(self) -> AsyncIterator[dict[str, Any] | FrameError]:
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEADER_BYTES:
                    yield FrameError(errors.PARSE_ERROR, "headers too long or missing the blank line")
                    self._resync(1)
                    continue
                if not await self._fill():
                    if self._buf.strip():
                        yield FrameError(errors.PARSE_ERROR, "the stream ended inside a frame's headers")
                    return
                continue
            headers = bytes(self._buf[:end])
            length, problem = _content_length(headers)
            if problem:
                yield FrameError(errors.PARSE_ERROR, problem)
                if length is None:
                    # No length to trust: a Content-Length header later in this block may start
                    # a frame (garbage glued in front of it); else look after this block.
                    inner = _HEADER_START.search(self._buf, 1, end)
                    self._resync(inner.start() if inner else end + 4)
                    continue
                # The length is known: skip the refused frame whole, body included.
                del self._buf[: end + 4]
                if not await self._skip(length):
                    return
                continue
            del self._buf[: end + 4]
            assert length is not None  # _content_length gives no problem only with a length
            if length > self.max_frame:
                yield FrameError(
                    errors.INVALID_REQUEST,
                    f"frame of {length} bytes is over the limit of {self.max_frame} bytes",
                )
                if not await self._skip(length):
                    return
                continue
            while len(self._buf) < length:
                if not await self._fill():
                    yield FrameError(errors.PARSE_ERROR, "the stream ended inside a frame's body")
                    return
            body = bytes(self._buf[:length])
            del self._buf[:length]
            yield _parse_body(body)

    async def _skip(self, n: int) -> bool:
        while True:
            if len(self._buf) >= n:
                del self._buf[:n]
                return True
            n -= len(self._buf)
            self._buf.clear()
            if not await self._fill():
                return False


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
