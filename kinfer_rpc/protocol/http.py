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
import logging
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kinfer_rpc.protocol import ollama, openai
from kinfer_rpc.protocol.web import Owners

if TYPE_CHECKING:
    from kinfer_rpc.protocol.server import Service

log = logging.getLogger("kinfer_rpc.http")


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


class InFlight:
    """Counts the HTTP requests in flight for the service (Service.face_request) and for their
    connection (Owners.request: a connection holds models only while a request of it runs)."""

    def __init__(self, app: Any, service: Service, owners: Owners):
        self.app = app
        self.service = service
        self.owners = owners

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with self.service.face_request(), self.owners.request(scope.get("client")):
            await self.app(scope, receive, send)


def make_app(service: Service, *, api_key: str | None = None, cors: list[str] | None = None) -> Starlette:
    """The Starlette app of both faces over `service`."""
    owners = Owners(service)
    routes = [*openai.routes(service, owners), *ollama.routes(service, owners)]

    async def root(request: Request) -> Response:
        return Response("kinfer is running", media_type="text/plain")

    routes.append(Route("/", root, methods=["GET", "HEAD"]))
    middleware = [Middleware(InFlight, service=service, owners=owners), Middleware(Auth, api_key=api_key)]
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
