"""What the HTTP faces share (kinfer_rpc.protocol.openai, kinfer_rpc.protocol.ollama; served by
kinfer_rpc.protocol.http): errors in an API's own shape with their HTTP status, the body read as
JSON within its limit, a response that runs a request while watching the client, and one owner
id per client connection."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kinfer_rpc import errors

if TYPE_CHECKING:
    from kinfer_rpc.protocol.server import Service

MAX_BODY = 32 * 1024 * 1024  # bytes a request body may have (413 beyond)

# kinfer's error codes as HTTP statuses
STATUS = {
    errors.PARSE_ERROR: 400,
    errors.INVALID_REQUEST: 400,
    errors.INVALID_PARAMS: 400,
    errors.MODEL_NOT_FOUND: 404,
    errors.CONTEXT_OVERFLOW: 400,
    errors.LOAD_FAILED: 500,
    errors.QUEUE_FULL: 429,
    errors.BACKEND_UNAVAILABLE: 400,
    errors.NOT_SUPPORTED: 400,
    errors.INTERNAL_ERROR: 500,
    errors.REQUEST_CANCELLED: 499,
}


class ApiError(Exception):
    """An error answered in the API's own shape: `status`, a message, and the field it is about."""

    def __init__(self, status: int, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.code = code

    @classmethod
    def of(cls, exc: errors.KinferError, fields: Callable[[str], str] | None = None) -> ApiError:
        """A kinfer error as the face says it: `fields` turns kinfer's field names into the API's."""
        data = exc.data if isinstance(exc.data, dict) else {}
        field = data.get("field") if isinstance(data.get("field"), str) else None
        message = exc.message
        if field is not None and fields is not None:
            named = fields(field)
            message = message.replace(field, named)
            field = named
        code = "model_not_found" if exc.code == errors.MODEL_NOT_FOUND else None
        return cls(STATUS.get(exc.code, 500), message, field, code)


def unsupported(field: str, why: str = "this server cannot honour it") -> ApiError:
    return ApiError(400, f"{field} is not supported: {why}", field, "unsupported_parameter")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 413 over MAX_BODY, 400 when it is not one."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"the request body is {size} bytes, over the limit of {MAX_BODY}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is over the limit of {MAX_BODY} bytes")
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


class Flow(Response):
    """A response that runs a flow while watching the client: `run(emit)` produces the answer,
    calling `emit(bytes)` for each streamed chunk; a client that disconnects cancels it. The
    status and headers go out with the first chunk (or the whole answer), so an error before
    anything was streamed is still answered with its status; `error(exc, streaming)` gives the
    status and body of an error (`streaming`: after chunks went out, as the stream's last)."""

    def __init__(
        self,
        run: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[bytes]],
        *,
        media_type: str,
        error: Callable[[ApiError, bool], tuple[int, bytes]],
        fields: Callable[[str], str] | None = None,
    ):
        super().__init__(media_type=media_type)
        self._run = run
        self._error = error
        self._fields = fields

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def start(status: int, media: str) -> None:
            nonlocal started
            started = True
            headers = [(b"content-type", media.encode())]
            if media == "text/event-stream":
                headers.append((b"cache-control", b"no-cache"))
            await send({"type": "http.response.start", "status": status, "headers": headers})

        async def emit(chunk: bytes) -> None:
            if not started:
                await start(200, self.media_type or "application/json")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()  # the flow's cancel reaches the engine
                        return

            tg.start_soon(watch)
            try:
                body = await self._run(emit)
                if not started:
                    await start(200, self.media_type or "application/json")
            except (ApiError, errors.KinferError) as exc:
                api = exc if isinstance(exc, ApiError) else ApiError.of(exc, self._fields)
                status, body = self._error(api, started)
                if not started:
                    await start(status, "application/json")
            await send({"type": "http.response.body", "body": body, "more_body": False})
            tg.cancel_scope.cancel()


class Owners:
    """One owner id (the runtime's fair shares, the models it holds) per client connection, while
    it has a request running: when its last request ends, the connection lets go of the models it
    held (they stay for their keep-alive), as a session does when it closes. An HTTP connection
    kept alive between requests holds nothing between them."""

    def __init__(self, service: Service):
        self._service = service
        self._ids: dict[tuple[str, int], int] = {}
        self._running: dict[tuple[str, int], int] = {}

    @staticmethod
    def _key(client: tuple[str, int] | Any) -> tuple[str, int]:
        return (client[0], client[1]) if client is not None else ("", 0)

    @contextlib.contextmanager
    def request(self, client: tuple[str, int] | None) -> Iterator[None]:
        """An HTTP request of `client` (the ASGI scope's), while it runs."""
        key = self._key(client)
        self._running[key] = self._running.get(key, 0) + 1
        try:
            yield
        finally:
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
                owner = self._ids.pop(key, None)
                if owner is not None:
                    self._service.runtime.release(owner)

    def of(self, request: Request) -> int:
        key = self._key(request.client)
        if key not in self._ids:
            self._ids[key] = self._service.new_owner()
        return self._ids[key]
