"""`kinfer serve`: one warm runtime for many clients, over a Unix socket.

The daemon speaks exactly the protocol and framing of `kinfer-rpc` on stdio to each connection,
and each connection is a session of its own (kinfer_rpc.protocol.server.Session): its lifecycle
(`initialize` ... `shutdown`/`exit`, which end the connection, not the daemon), request ids,
progress tokens and cancels. Every session shares one Service: one runtime, so a model loads once
and every client's requests run in the same batches, with the same reply for the same request
whatever else runs. A connection that closes has its requests cancelled and the models it held
released (each stays loaded for its keep-alive). SIGTERM or SIGINT (`kinfer stop`) answers what
is in flight (-32800, "the daemon is stopping") and exits 0.

Only its owner gets in: the socket's folder is a real 0700 directory owned by the user, the socket
0600, and each connection's peer (SO_PEERCRED) must be the same user; there is no TCP listener. A
socket left by a dead daemon is replaced; a live one is never taken over: a second daemon on the
same socket refuses to start. Starting is serialized by a lock file beside the socket
(`kinfer.lock`), which `kinfer-rpc --attach` (kinfer_rpc.protocol.attach) also takes, so that two
editors starting at once end with one daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs
from anyio.abc import SocketAttribute, SocketStream

from kinfer_rpc import __version__, errors
from kinfer_rpc.host.files import Unsafe, private_dir
from kinfer_rpc.protocol.framing import MAX_FRAME_BYTES, encode
from kinfer_rpc.protocol.params import keep_alive as parse_keep_alive
from kinfer_rpc.protocol.rendezvous import default_socket, live, start_lock
from kinfer_rpc.protocol.server import LOG_LEVELS, Service, Session

if TYPE_CHECKING:
    from kinfer_rpc.protocol.http import Http

log = logging.getLogger("kinfer_rpc.daemon")

MAX_CONNECTIONS = 256  # connections at once; one more is answered with an error and closed
DEFAULT_KEEP_ALIVE = "5m"  # as Ollama's OLLAMA_KEEP_ALIVE


def peer(stream: SocketStream) -> tuple[int, int]:
    """The connected process's (pid, uid), from the kernel (SO_PEERCRED)."""
    raw = stream.extra(SocketAttribute.raw_socket)
    creds = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


class _Received:
    """A socket stream as the framing reads bytes: b"" once the peer has gone."""

    def __init__(self, stream: SocketStream):
        self._stream = stream

    async def receive(self) -> bytes:
        try:
            return await self._stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return b""


class Daemon:
    """A Service and the sessions of the socket's connections."""

    def __init__(
        self, path: Path, *, keep_alive: float, max_frame: int = MAX_FRAME_BYTES, http: HttpOptions | None = None
    ):
        self.path = path
        self.max_frame = max_frame
        self.service = Service(socket=str(path))
        self.service.runtime.keep_alive = keep_alive
        self.sessions: set[Session] = set()
        self.stopping = False
        self._stop = anyio.Event()
        self.http: Http | None = None
        if http is not None:
            from kinfer_rpc.protocol.http import Http

            self.http = Http(self.service, http.host, http.port, api_key=http.api_key, cors=http.cors)
            self.service.faces += 1

    async def _refuse(self, stream: SocketStream, message: str) -> None:
        """One error answer (id null) and the connection closed."""
        with contextlib.suppress(Exception):
            frame = {"jsonrpc": "2.0", "id": None, "error": {"code": errors.INVALID_REQUEST, "message": message}}
            with anyio.move_on_after(1.0):
                await stream.send(encode(frame))
        with contextlib.suppress(Exception):
            await stream.aclose()

    async def handle(self, stream: SocketStream) -> None:
        try:
            pid, uid = peer(stream)
        except OSError as exc:
            log.warning("a connection without peer credentials was refused: %s", exc)
            await stream.aclose()
            return
        if uid != os.getuid():
            log.warning("refused a connection from uid %d (pid %d): only uid %d may connect", uid, pid, os.getuid())
            await self._refuse(stream, "this daemon answers only the user who started it")
            return
        if self.stopping:
            await self._refuse(stream, "the daemon is stopping")
            return
        if len(self.sessions) >= MAX_CONNECTIONS:
            log.warning("refused a connection from pid %d: %d connections are open", pid, MAX_CONNECTIONS)
            await self._refuse(stream, f"the daemon has {MAX_CONNECTIONS} connections open, its most")
            return
        session = Session(stream, max_frame=self.max_frame, service=self.service, peer_pid=pid)
        logging.getLogger().addHandler(session.log_handler)
        self.sessions.add(session)
        log.info("connection %d from pid %d (%d open)", session.owner, pid, len(self.sessions))
        try:
            await session.run(_Received(stream))
        finally:
            self.sessions.discard(session)
            logging.getLogger().removeHandler(session.log_handler)
            with contextlib.suppress(Exception):
                await stream.aclose()
            log.info("connection %d closed (%d open)", session.owner, len(self.sessions))

    def stop(self, signum: int) -> None:
        log.warning("%s: answering the requests in flight and stopping", signal.Signals(signum).name)
        self.stopping = True
        for session in list(self.sessions):
            session.stop(0, reason="the daemon is stopping")
        self._stop.set()

    async def run(self, listener: anyio.abc.Listener[SocketStream]) -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.service.background)
            accepting = anyio.CancelScope()

            async def accept(sessions: anyio.abc.TaskGroup) -> None:
                with accepting:
                    await listener.serve(self.handle, task_group=sessions)

            async with anyio.create_task_group() as sessions:
                sessions.start_soon(accept, sessions)
                if self.http is not None:
                    sessions.start_soon(self.http.serve)
                await self._stop.wait()
                if self.http is not None:
                    self.http.stop()  # no new requests; uvicorn waits for the ones in flight
                accepting.cancel()  # no new connections; the sessions answer what they run and end
                with anyio.move_on_after(5.0):
                    while self.sessions:
                        await anyio.sleep(0.02)
                sessions.cancel_scope.cancel()
            with contextlib.suppress(Exception):
                await listener.aclose()
            with contextlib.suppress(OSError):
                self.path.unlink()
            await self.service.close()
            tg.cancel_scope.cancel()
        return 0


@attrs.frozen
class HttpOptions:
    """`kinfer serve --http`: where the HTTP faces listen, their API key and CORS origins."""

    host: str
    port: int
    api_key: str | None = None
    cors: list[str] | None = None


async def serve(
    path: Path,
    *,
    keep_alive: float,
    max_frame: int = MAX_FRAME_BYTES,
    locked: bool = False,
    http: HttpOptions | None = None,
) -> int:
    """Listen on `path` and serve until stopped; 1 when another daemon already answers there.
    `locked`: the starter holds the start lock (kinfer-rpc --attach starting this daemon).
    `http`: also serve OpenAI's and Ollama's HTTP APIs (kinfer_rpc.protocol.http)."""
    daemon = Daemon(path, keep_alive=keep_alive, max_frame=max_frame, http=http)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # before anyone can connect
        loop.add_signal_handler(signum, daemon.stop, signum)
    with contextlib.nullcontext() if locked else start_lock(path):
        private_dir(path.parent)
        if live(path):
            log.error("a kinfer daemon already answers on %s", path)
            return 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead daemon's socket
        old = os.umask(0o177)  # the socket is made 0600, never wider even for a moment
        try:
            listener = await anyio.create_unix_listener(path)
        finally:
            os.umask(old)
    os.chmod(path, 0o600)
    log.warning("kinfer %s daemon on %s (pid %d)", __version__, path, os.getpid())
    if http is not None:
        log.warning("HTTP faces (OpenAI /v1, Ollama /api) on http://%s:%d", http.host, http.port)
    return await daemon.run(listener)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, help=f"the socket to listen on (default: {default_socket()})")
    parser.add_argument(
        "--keep-alive",
        default=os.environ.get("KINFER_KEEP_ALIVE", DEFAULT_KEEP_ALIVE),
        help='how long a model stays loaded once idle unless a load or request says: "5m", "1h", 0, -1 (forever)',
    )
    parser.add_argument("--log-level", default="warning", choices=sorted(LOG_LEVELS))
    parser.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES)
    parser.add_argument("--locked", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        default=None,
        help="also serve OpenAI's (/v1) and Ollama's (/api) HTTP APIs (host default 127.0.0.1)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KINFER_API_KEY"),
        help="the Bearer key HTTP clients must send (also KINFER_API_KEY); needed off loopback",
    )
    parser.add_argument("--cors", action="append", metavar="ORIGIN", help="allow this browser origin (repeatable)")


def run(args: argparse.Namespace) -> int:
    """`kinfer serve` with parsed arguments: the daemon in the foreground, logging to stderr."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    try:
        keep = parse_keep_alive(args.keep_alive)
    except errors.KinferError as exc:
        print(f"kinfer serve: --keep-alive: {exc.message.removeprefix('params.keepAlive ')}", file=sys.stderr)
        return 2
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(LOG_LEVELS[args.log_level])
    handler.setFormatter(logging.Formatter("kinfer serve %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    path = Path(args.socket).absolute() if args.socket else default_socket()
    http = None
    if args.http:
        from kinfer_rpc.protocol.http import loopback, parse_address

        try:
            host, port = parse_address(args.http)
        except ValueError as exc:
            print(f"kinfer serve: --http: {exc}", file=sys.stderr)
            return 2
        if not loopback(host) and not args.api_key:
            print(f"kinfer serve: --http on {host} (not a loopback address) needs --api-key", file=sys.stderr)
            return 2
        http = HttpOptions(host, port, args.api_key, args.cors)
    try:
        code = anyio.run(
            lambda: serve(
                path,
                keep_alive=float("inf") if keep is None else keep,
                max_frame=args.max_frame_bytes,
                locked=args.locked,
                http=http,
            ),
            backend="asyncio",
        )
    except Unsafe as exc:
        print(f"kinfer serve: {exc}", file=sys.stderr)
        return 1
    logging.shutdown()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kinfer serve", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
