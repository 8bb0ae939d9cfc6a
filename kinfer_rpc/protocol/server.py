"""`kinfer-rpc`: the process an editor spawns. Stdout carries frames and nothing else.

A `Service` is what one process holds for all its clients (the plugins, the runtime and its
models, the status file `kinfer ps` reads); a `Session` is one client's connection to it, with its
own lifecycle, ids, progress tokens and cancels. `kinfer-rpc` is one session over stdio that owns
its service; the daemon (kinfer_rpc.protocol.daemon) serves many sessions over a Unix socket.

At start-up the real stdout is moved aside and file descriptor 1 pointed at stderr, so native
libraries that print can never corrupt the stream. The lifecycle follows LSP: `initialize`
first (other requests get -32002), `initialized`, `shutdown`, `exit` (0 after shutdown, else 1).
Lifecycle state changes take effect in message order, however the messages arrive. The server
also exits when stdin closes, when the client's process dies, when its parent process dies and on
SIGINT, SIGTERM or SIGHUP (exit code 128 + the signal). Whatever ends it, the requests in flight
are answered -32800 with their partial results first; a watchdog thread (protocol.watchdog) ends
the process with the same exit code if that has not happened within 1.5 s (a held event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import ByteSendStream
from anyio.streams.file import FileWriteStream

from kinfer_rpc import PROTOCOL_VERSION, __version__, errors
from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.host.runtime import Runtime
from kinfer_rpc.host.status import INTERVAL as STATUS_INTERVAL
from kinfer_rpc.host.status import StatusFile
from kinfer_rpc.host.status import models as status_models
from kinfer_rpc.protocol.connection import Connection, RequestContext
from kinfer_rpc.protocol.fields import Fields
from kinfer_rpc.protocol.framing import MAX_FRAME_BYTES, ByteSource, FrameReader, encode
from kinfer_rpc.protocol.handlers import Handlers
from kinfer_rpc.protocol.lsp import METHODS as LSP_COMPLETIONS
from kinfer_rpc.protocol.lsp import Editor
from kinfer_rpc.protocol.lsp import capabilities as lsp_capabilities
from kinfer_rpc.protocol.watchdog import Watchdog
from kinfer_rpc.protocol.watchdog import alive as _alive

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

log = logging.getLogger("kinfer_rpc")

# InitializeParams members of LSP 3.17 that kinfer takes and ignores (processId and
# initializationOptions it reads; workDoneToken the connection takes).
LSP_INITIALIZE_FIELDS = ("clientInfo", "locale", "rootPath", "rootUri", "capabilities", "trace", "workspaceFolders")
LOG_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
# The requests `kinfer ps` counts as running (a load shows as the model's state).
INFERENCE_METHODS = frozenset(
    {
        "inference/generate",
        "inference/chat",
        "inference/infill",
        "textDocument/completion",
        "textDocument/inlineCompletion",
    }
)
MESSAGE_TYPE = {logging.ERROR: 1, logging.WARNING: 2, logging.INFO: 3, logging.DEBUG: 4}


class ClientLogHandler(logging.Handler):
    """Sends log records to the client as window/logMessage once it asked for them."""

    def __init__(self, server: Session):
        super().__init__(logging.CRITICAL + 1)
        self.server = server

    def emit(self, record: logging.LogRecord) -> None:
        loop = self.server.loop
        if loop is None or loop.is_closed():
            return
        message = {"type": MESSAGE_TYPE.get(record.levelno, 4), "message": self.format(record)}
        if threading.get_ident() == self.server.loop_thread:
            self.server.queue_notification("window/logMessage", message)
        else:
            loop.call_soon_threadsafe(self.server.queue_notification, "window/logMessage", message)


def send_seconds() -> float:
    """KINFER_SEND_SECONDS: how long a daemon waits for a client to read what it is sent (default 30)."""
    try:
        return max(0.1, float(os.environ.get("KINFER_SEND_SECONDS", "30")))
    except ValueError:
        return 30.0


class Service:
    """What every session of one process shares: the plugins, the runtime with its models and the
    requests on them, and `kinfer ps`'s status file. `socket`: the daemon's, for ps."""

    def __init__(self, *, socket: str | None = None):
        self.plugins = load_plugins()
        self.runtime = Runtime(self.plugins)
        self.handlers = Handlers(self.runtime)
        self.sessions: set[Session] = set()
        self.socket = socket
        self._ids = itertools.count(1)
        # HTTP requests in flight: while there are, the faces count as a client beside the
        # sessions (many, really; each HTTP connection is an owner of its own)
        self.face_requests = 0

    def _share(self) -> None:
        self.runtime.share(len(self.sessions) + (1 if self.face_requests else 0))

    def open(self, session: Session) -> int:
        """A session starts: its owner id (the models it holds, its share of their slots)."""
        self.sessions.add(session)
        self._share()
        return next(self._ids)

    @contextlib.contextmanager
    def face_request(self) -> Iterator[None]:
        """An HTTP request, while it runs. Faces that serve no request share no slots: a lone
        session beside an idle HTTP face keeps every slot of its model (its last one too)."""
        self.face_requests += 1
        if self.face_requests == 1:
            self._share()
        try:
            yield
        finally:
            self.face_requests -= 1
            if not self.face_requests:
                self._share()

    def new_owner(self) -> int:
        """An owner id for a client that is not a session (an HTTP face's connection)."""
        return next(self._ids)

    def close_session(self, session: Session) -> None:
        """A session ended: the models it held stay for their keep-alive, held by the others."""
        self.sessions.discard(session)
        self.runtime.release(session.owner)
        self._share()

    async def background(self) -> None:
        """Until cancelled: the status file, and models unloaded once idle past their keep-alive."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_status)
            tg.start_soon(self._reap)

    async def _reap(self) -> None:
        while True:
            await anyio.sleep(0.5)
            try:
                for gone in await self.runtime.reap():
                    self.handlers.renderer.stop(gone)  # (none should be rendering: it was idle)
            except Exception:  # noqa: BLE001 - an unload that failed is logged; the next look tries again
                log.exception("unloading an idle model failed")

    async def _write_status(self) -> None:
        """`kinfer ps`'s view of this process ($KINFER_HOME/run/<pid>.json), written when it
        changes; removed when the service ends (this task is cancelled then)."""
        status = StatusFile()
        try:
            while True:
                try:
                    running = sum(
                        1
                        for session in list(self.sessions)
                        for _, ctx in list(session.connection._running.values())
                        if ctx.method in INFERENCE_METHODS
                    )
                    extra = (
                        {"daemon": {"socket": self.socket, "connections": len(self.sessions)}} if self.socket else {}
                    )
                    status.update(status_models(self.runtime), running, **extra)
                except Exception as exc:  # noqa: BLE001 - never the server's concern
                    log.debug("the status file was not updated: %s", exc)
                await anyio.sleep(STATUS_INTERVAL)
        finally:
            status.remove()

    async def close(self) -> None:
        """Every model unloaded, the template workers stopped."""
        await self.handlers.renderer.aclose()
        await anyio.to_thread.run_sync(self.runtime.close)


class Session:
    """One client's connection: its lifecycle (initialize ... shutdown, exit), its requests and
    their progress, its LSP documents. `owns` its service (kinfer-rpc over stdio): shutdown
    unloads the models and the session's end is the process's; else (the daemon) shutdown and
    exit end this session only."""

    def __init__(
        self,
        write_stream: ByteSendStream,
        *,
        max_frame: int = MAX_FRAME_BYTES,
        service: Service | None = None,
        peer_pid: int | None = None,
    ):
        self.state = "uninitialized"  # -> initialized -> shutdown
        self.owns = service is None
        self.service = service or Service()
        self.plugins = self.service.plugins
        self.runtime = self.service.runtime
        self.max_frame = max_frame
        self.exit_code: int | None = None
        self.client_pid: int | None = None
        self.peer_pid = peer_pid  # a daemon's connection: the process that connected
        # How long one write may wait for the client to read: a daemon's connection whose client
        # reads nothing that long is closed (its answers would pile up); kinfer-rpc's own stdout
        # waits for as long as its one client takes.
        self.send_seconds = float("inf") if self.owns else send_seconds()
        # kinfer-rpc's own process: the client's and the parent's death, signals, and a deadline on
        # every way of ending (a daemon's session ends when its socket closes, or its client dies).
        self.watchdog = (
            Watchdog(self._stop_from_outside, lambda: self.client_pid, lambda: self.exit_code) if self.owns else None
        )
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self._write = write_stream
        self._out_send: MemoryObjectSendStream[dict[str, Any]]
        self._out_recv: MemoryObjectReceiveStream[dict[str, Any]]
        self._out_send, self._out_recv = anyio.create_memory_object_stream(float("inf"))
        self.log_handler = ClientLogHandler(self)
        self.log_handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self._stop = anyio.Event()
        self.owner = self.service.open(self)
        r = self.handlers = self.service.handlers
        # LSP's editor features: code completion from the model for stock LSP clients.
        lsp = self.editor = Editor(
            r.inference_infill,
            r.model_load,
            lambda name: name in self.runtime.loaded,
            self.queue_notification,
        )
        self.connection = Connection(
            self.send,
            {
                "initialize": self.initialize,
                "shutdown": self.shutdown,
                "model/list": r.model_list,
                "model/load": r.model_load,
                "model/unload": r.model_unload,
                "model/status": r.model_status,
                "inference/generate": r.inference_generate,
                "inference/chat": r.inference_chat,
                "inference/infill": r.inference_infill,
                "inference/tokenize": r.inference_tokenize,
                "inference/embed": r.inference_embed,
                "inference/rerank": r.inference_rerank,
                "textDocument/completion": lsp.completion,
                "textDocument/inlineCompletion": lsp.inline_completion,
                "workspace/executeCommand": lsp.execute_command,
            },
            {
                "initialized": self.initialized,
                "exit": self.exit,
                "textDocument/didOpen": lsp.did_open,
                "textDocument/didChange": lsp.did_change,
                "textDocument/didClose": lsp.did_close,
                "textDocument/didSave": lsp.did_save,
                "workspace/didChangeConfiguration": lsp.did_change_configuration,
            },
            gate=self.gate,
            accept=self.accept,
            send_nowait=self._send_nowait,
            owner=self.owner,
        )

    # -- output: one writer, whole frames ---------------------------------------------------
    async def send(self, message: dict[str, Any]) -> None:
        await self._out_send.send(message)

    def queue_notification(self, method: str, params: Any) -> None:
        self._send_nowait({"jsonrpc": "2.0", "method": method, "params": params})

    def _send_nowait(self, message: dict[str, Any]) -> None:
        try:
            self._out_send.send_nowait(message)  # the stream is unbounded: this never blocks
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _writer(self) -> None:
        # Every message queued by the time the last write ended goes out in one write: a step of
        # many streams queues one notification each, and a write is a trip to a worker thread.
        async for message in self._out_recv:
            frames = [frame] if (frame := self._frame(message)) else []
            while True:
                try:
                    message = self._out_recv.receive_nowait()
                except anyio.WouldBlock:
                    break
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                if frame := self._frame(message):
                    frames.append(frame)
            if not frames:
                continue
            try:
                with anyio.fail_after(self.send_seconds):
                    await self._write.send(b"".join(frames))
            except TimeoutError:
                # A daemon's client that stopped reading: its answers would queue without end.
                log.warning("the client read nothing for %g s; closing its connection", self.send_seconds)
                self._end(1)
                return
            except Exception:
                log.error("stdout is gone; stopping")
                self._stop.set()
                return

    def _frame(self, message: dict[str, Any]) -> bytes | None:
        """One message's frame; an answer over the frame limit becomes an error, and a message
        that cannot be encoded is dropped (None), never the server."""
        try:
            frame = encode(message)
            if len(frame) > self.max_frame and "id" in message and "method" not in message:
                # Never a frame over the limit the server advertises: the answer becomes an error.
                frame = encode(
                    {
                        "jsonrpc": "2.0",
                        "id": message["id"],
                        "error": {
                            "code": errors.RESPONSE_TOO_LARGE,
                            "message": f"the answer would be a frame of {len(frame)} bytes, over the "
                            f"limit of {self.max_frame} (maxFrameBytes): ask for less",
                            "data": None,
                        },
                    }
                )
        except Exception:
            log.exception("could not encode a message; dropped it")
            return None
        return frame

    # -- lifecycle ---------------------------------------------------------------------------
    def gate(self, method: str, is_request: bool) -> errors.KinferError | None:
        if method == "exit":
            return None
        if self.state == "uninitialized" and method != "initialize":
            return errors.KinferError(errors.SERVER_NOT_INITIALIZED, f"{method}: the server is not initialized yet")
        if self.state != "uninitialized" and method == "initialize":
            return errors.KinferError(errors.INVALID_REQUEST, "initialize was already called")
        if self.state == "shutdown":
            return errors.KinferError(errors.INVALID_REQUEST, f"{method}: the server is shutting down")
        return None

    def accept(self, method: str, params: dict[str, Any] | list[Any]) -> errors.KinferError | None:
        """A request about to start, in arrival order: the lifecycle's state changes happen here,
        before the next message is gated, not in the handler's task (which starts later)."""
        try:
            if method == "initialize":
                self._initialize(_named(params))
            elif method == "shutdown":
                Fields(_named(params), "params").done()
                self.state = "shutdown"
            elif method in LSP_COMPLETIONS:
                self.editor.accept(method, params)
        except errors.KinferError as exc:
            return exc
        return None

    def _initialize(self, p: dict[str, Any]) -> None:
        f = Fields(p, "params")
        pid = f.int("processId", None, lo=0)
        for name in LSP_INITIALIZE_FIELDS:  # a stock LSP client's: accepted and ignored
            f.raw(name)
        init = f.raw("initializationOptions")
        f.done()
        if init is None:
            init = {}
        if not isinstance(init, dict):
            raise errors.invalid_params("params.initializationOptions must be an object")
        level = init.get("logLevel")
        if level is not None and level not in LOG_LEVELS:
            raise errors.invalid_params("initializationOptions.logLevel must be one of " + ", ".join(LOG_LEVELS))
        self.editor.initialize(init)  # the completion settings (raises before anything changed)
        if level is not None:
            self.log_handler.setLevel(LOG_LEVELS[level])
        if pid is not None and self.client_pid is None:
            self.client_pid = pid
        self.state = "initialized"

    async def initialize(self, ctx: RequestContext, /, *_: Any, **__: Any) -> dict[str, Any]:
        # The params were checked and applied by accept().
        for broken in self.plugins.broken:
            self.queue_notification(
                "window/logMessage",
                {"type": 1, "message": f"plugin {broken['name']} was skipped: {broken['error']}"},
            )
        return {
            "serverInfo": {"name": "kinfer-rpc", "version": __version__},
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {
                **self.plugins.capabilities(),
                "methods": sorted(self.connection._methods),
                "partialResults": True,
                "workDoneProgress": True,
                "cancellation": True,
                "maxFrameBytes": self.max_frame,
                **lsp_capabilities(),
            },
        }

    async def initialized(self, /, *args: Any, **_: Any) -> None:
        # LSP's InitializedParams is an empty object; anything else is harmless, and said once.
        if args:
            log.warning("initialized: params must be an object; ignored them")

    async def shutdown(self, ctx: RequestContext, /, *_: Any, **__: Any) -> None:
        # accept() checked the params and set the state. A daemon's session leaves the models
        # to the others (they stay for their keep-alive).
        if self.owns:
            await self.service.close()
        return None

    async def exit(self, /, *_: Any, **__: Any) -> None:
        # Honoured whatever its params: LSP's exit has none, and nothing must keep it from ending.
        self.exit_code = 0 if self.state == "shutdown" else 1
        self._stop.set()

    async def _watch_client(self) -> None:
        """A daemon's session: its client's process (initialize's processId) dying ends it."""
        while True:
            await anyio.sleep(1.0)
            pid = self.client_pid
            if pid and not _alive(pid):
                log.warning("the client process %d died; closing its connection", pid)
                self._end(1)
                return

    def _stop_from_outside(self, code: int, why: str) -> None:
        """The watchdog's thread: the client or the parent died, or a signal came. The loop ends
        the server as `exit` would, with `code` unless it has one already."""
        loop = self.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the end is under way
                loop.call_soon_threadsafe(self._end, code)

    def _end(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
        self._stop.set()

    def stdin_ended(self) -> None:
        """The stdin reader's thread: no more input. The loop reads on to the end of what came
        (the lifecycle's state, hence the exit code, follows it); the watchdog makes sure the
        process ends even if the loop cannot."""
        if self.watchdog is not None:
            self.watchdog.arm(0 if self.state == "shutdown" else 1)

    def stop(self, exit_code: int, reason: str | None = None) -> None:
        """End this session as `exit` would, answering its requests in flight with -32800 and
        `reason` (the daemon stopping)."""
        if self.exit_code is None:
            self.exit_code = exit_code
        if reason is not None:
            self.connection.cancel_reason = reason
        self._stop.set()

    async def run(self, read_stream: ByteSource) -> int:
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        if self.watchdog is not None:
            self.watchdog.start()
            self.watchdog.catch_signals()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._writer)
            tg.start_soon(self.editor.background)
            if self.owns:
                tg.start_soon(self.service.background)
            else:
                tg.start_soon(self._watch_client)

            async def read() -> None:
                await self.connection.serve(FrameReader(read_stream, self.max_frame))
                # stdin closed: nothing more will come
                if self.exit_code is None:
                    self.exit_code = 0 if self.state == "shutdown" else 1
                self._stop.set()

            tg.start_soon(read)
            await self._stop.wait()
            if self.watchdog is not None:
                self.watchdog.arm(self.exit_code if self.exit_code is not None else 1)
            # Whatever ends the server (exit, stdin closed, a signal, the client gone), every
            # request still running is answered: -32800 with its partial result.
            self.connection.cancel_all()
            self.editor.stop()  # warming, computing ahead: no one will ask for it now
            with anyio.move_on_after(2.0):
                while self.connection.running:
                    await anyio.sleep(0.01)
            self.loop = None
            self.service.close_session(self)
            if self.owns:
                await self.service.close()
            # Let what is queued reach the client, briefly.
            self._out_send.close()
            with anyio.move_on_after(1.0):
                while self._out_recv.statistics().current_buffer_used:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        if self.watchdog is not None:
            self.watchdog.close()
        return self.exit_code if self.exit_code is not None else 1


class StdinStream:
    """Bytes from a file descriptor, read by a daemon thread.

    anyio's file streams read in worker threads that cannot be cancelled, so a server told to
    exit would wait for the next byte on stdin; this reader leaves its thread behind instead.
    """

    def __init__(self, fd: int, on_end: Callable[[], None] | None = None):
        self._fd = fd
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def pump() -> None:
            while True:
                try:
                    data = os.read(self._fd, 65536)
                except OSError:
                    data = b""
                loop.call_soon_threadsafe(self._queue.put_nowait, data)
                if not data:
                    if on_end is not None:
                        on_end()  # here, not on the loop: the loop may be held
                    return

        threading.Thread(target=pump, name="kinfer-stdin", daemon=True).start()

    async def receive(self) -> bytes:
        return await self._queue.get()


def _process_id(text: str) -> int:
    """--clientProcessId: a number a process id can be (os.kill refuses the rest)."""
    try:
        pid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if not 1 <= pid < 2**31:
        raise argparse.ArgumentTypeError(f"not a process id: {pid} (1 to {2**31 - 1})")
    return pid


def _named(params: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """Params for a method that takes named params only: an empty array is none at all."""
    if isinstance(params, dict):
        return params
    if params:
        raise errors.invalid_params("params must be an object")
    return {}


def _take_stdout() -> int:
    """Move the real stdout aside and point fd 1 at stderr; return the fd frames go to."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # before llama.cpp loads: an abort never forks gdb
    parser = argparse.ArgumentParser(prog="kinfer-rpc", description=(__doc__ or "kinfer-rpc").splitlines()[0])
    parser.add_argument("--clientProcessId", type=_process_id, default=None, help="exit when this process dies")
    parser.add_argument("--log-file", default=None, help="also write logs to this file")
    parser.add_argument("--log-level", default="warning", choices=sorted(LOG_LEVELS))
    parser.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES)
    parser.add_argument("--stdio", action="store_true", help="accepted for LSP clients; stdio is the only transport")
    parser.add_argument(
        "--attach",
        action="store_true",
        default=os.environ.get("KINFER_ATTACH", "") not in ("", "0"),
        help="be a proxy to the kinfer daemon (kinfer serve), starting it when none runs (also KINFER_ATTACH=1)",
    )
    parser.add_argument("--socket", default=None, help="the daemon's socket, with --attach")
    parser.add_argument("--version", action="version", version=f"kinfer-rpc {__version__}")
    args = parser.parse_args(argv)

    out_fd = _take_stdout()
    if args.attach:
        from pathlib import Path

        from kinfer_rpc.protocol import attach

        logging.basicConfig(level=LOG_LEVELS[args.log_level], format="kinfer-rpc --attach %(levelname)s: %(message)s")
        code = attach.run(Path(args.socket).absolute() if args.socket else None, stdout_fd=out_fd)
        sys.stderr.flush()
        os._exit(code)
    root = logging.getLogger()
    root.setLevel(logging.DEBUG)
    stderr_handler = logging.StreamHandler(sys.stderr)
    stderr_handler.setLevel(LOG_LEVELS[args.log_level])
    stderr_handler.setFormatter(logging.Formatter("kinfer-rpc %(levelname)s %(name)s: %(message)s"))
    root.addHandler(stderr_handler)
    if args.log_file:
        fh = logging.FileHandler(args.log_file)
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)

    async def amain() -> int:
        write = FileWriteStream(os.fdopen(out_fd, "wb", buffering=0))
        server = Session(write, max_frame=args.max_frame_bytes)
        read = StdinStream(0, on_end=server.stdin_ended)
        root.addHandler(server.log_handler)
        if args.clientProcessId:
            server.client_pid = args.clientProcessId
        return await server.run(read)

    code = anyio.run(amain, backend="asyncio")
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)  # the stdin reader thread may still block in read(); don't wait for it


if __name__ == "__main__":
    main()
