"""The HTTP faces: OpenAI's and Ollama's APIs on the daemon's runtime (`kinfer serve --http`).

A face is as thin as the stdio protocol's handlers: a route reads the API's JSON into the host's
typed requests (kinfer_rpc.protocol.openai, kinfer_rpc.protocol.ollama), the host runs them
(kinfer_rpc.host.requests), and the route writes the reply in the API's shape, whole or streamed
(server-sent events for OpenAI, JSON lines for Ollama). It runs on Starlette under uvicorn, in the
daemon's event loop, so the same models, batches and promise serve every face.

What the faces do beyond the APIs:
- a field a face cannot honour is a 400 whose message names it, never dropped;
- errors are each API's own shape (OpenAI `{"error": {message, type, param, code}}`, Ollama
  `{"error": message}`) with a status that says what happened;
- a client that disconnects cancels its request (streamed or not);
- loopback by default; any other address needs an API key (Bearer, compared in constant time);
  bodies over MAX_BODY are 413; CORS only for the origins `--cors` names.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kinfer_rpc import errors

if TYPE_CHECKING:
    from kinfer_rpc.protocol.server import Service

log = logging.getLogger("kinfer_rpc.http")

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
    """One owner id (the runtime's fair shares, the models it holds) per client connection."""

    def __init__(self, service: Service):
        self._service = service
        self._ids: dict[tuple[str, int], int] = {}

    def of(self, request: Request) -> int:
        client = request.client
        key = (client.host, client.port) if client is not None else ("", 0)
        if key not in self._ids:
            if len(self._ids) > 4096:  # forget the oldest connections' ids
                for old in list(self._ids)[:1024]:
                    del self._ids[old]
            self._ids[key] = self._service.new_owner()
        return self._ids[key]


class Auth:
    """ASGI middleware: a Bearer API key on every request when one is set (constant-time compare)."""

    def __init__(self, app: Any, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.api_key is not None:
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                body: dict[str, Any]
                if scope.get("path", "").startswith("/api/"):
                    body = {"error": "unauthorized: this server needs its API key (Authorization: Bearer KEY)"}
                else:
                    body = {
                        "error": {
                            "message": "this server needs its API key (Authorization: Bearer KEY)",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    }
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_app(service: Service, *, api_key: str | None = None, cors: list[str] | None = None) -> Starlette:
    """The Starlette app of both faces over `service`."""
    from kinfer_rpc.protocol import ollama, openai

    owners = Owners(service)
    routes = [*openai.routes(service, owners), *ollama.routes(service, owners)]

    async def root(request: Request) -> Response:
        return Response("kinfer is running", media_type="text/plain")

    routes.append(Route("/", root, methods=["GET", "HEAD"]))
    middleware = [Middleware(Auth, api_key=api_key)]
    if cors:
        middleware.append(
            Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"])
        )
    return Starlette(routes=routes, middleware=middleware)


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_address(text: str) -> tuple[str, int]:
    """`[HOST:]PORT` (IPv6 hosts in brackets); the host defaults to 127.0.0.1."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{text!r} is not [HOST:]PORT")
    return host, int(port)


class _Server(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon takes the signals, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class Http:
    """The HTTP faces of one service, served until stop()."""

    def __init__(self, service: Service, host: str, port: int, *, api_key: str | None, cors: list[str] | None):
        if not loopback(host) and not api_key:
            raise ValueError(f"--http on {host}, which is not a loopback address, needs --api-key")
        self.app = make_app(service, api_key=api_key, cors=cors)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            limit_concurrency=1024,
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = _Server(config)

    async def serve(self) -> None:
        await self.server.serve()

    @property
    def port(self) -> int | None:
        """The port listened on (the one the OS chose for port 0), once listening."""
        for server in getattr(self.server, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    def stop(self) -> None:
        self.server.should_exit = True
