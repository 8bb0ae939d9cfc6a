"""The kinfer-rpc an adapter talks to, shared by every adapter object of this process.

A LangChain program makes a chat model object per chain, a test suite one per test, and `llm`
one per prompt: a server each would load the model each time. Instead one `Client` serves every
object that names the same command and environment; it is thread-safe, so sync and async calls
share it too, and it shuts its server down when the process exits.

Which server: the daemon's (`kinfer-rpc --attach`, models stay warm between programs) when one
answers on its socket, else a `kinfer-rpc` of this process's own, as the `kinfer` command
chooses. `attach=True` always attaches (starting the daemon when none runs), `attach=False`
never does.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path

from kinfer_rpc.client import Client, Result, Stream, server_command


def command(attach: bool | None = None, socket: str | os.PathLike[str] | None = None) -> list[str]:
    """The server command: `kinfer-rpc`, or `kinfer-rpc --attach [--socket PATH]` for the daemon.
    `attach=None` attaches when a daemon answers on `socket` (default: the daemon's own)."""
    base = server_command()
    if attach is None:
        from kinfer_rpc.protocol.rendezvous import default_socket, live

        try:
            attach = live(Path(socket) if socket is not None else default_socket(), timeout=1.0)
        except OSError:
            attach = False
    if not attach:
        return base
    return [*base, "--attach", *(["--socket", os.fspath(socket)] if socket is not None else [])]


_lock = threading.Lock()
_clients: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...]], Client] = {}


def shared(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Client:
    """The one Client of this process for `argv` run with `env` added to the environment,
    started on first use, and again when its server has exited."""
    key = (tuple(argv), tuple(sorted((env or {}).items())))
    with _lock:
        client = _clients.get(key)
        if client is None or client.returncode is not None:
            client = Client(list(argv), env={**os.environ, **env} if env else None)
            _clients[key] = client
        return client


def discard(client: Client) -> None:
    """Shut a shared client's server down now (the next `shared` call starts a fresh one)."""
    with _lock:
        for key, c in list(_clients.items()):
            if c is client:
                del _clients[key]
    client.close(timeout=2.0)


# -- the thread-based client from a loop ----------------------------------------------------------
async def pieces(stream: Stream) -> AsyncGenerator[str, None]:
    """A stream's pieces, each awaited off the loop. Leaving early, or the task being cancelled,
    closes the stream: its request is cancelled on the server."""
    loop = asyncio.get_running_loop()
    it = iter(stream)
    with stream:
        while (piece := await loop.run_in_executor(None, next, it, None)) is not None:
            yield piece


async def finished(stream: Stream, timeout: float | None = None) -> Result:
    """A stream's Result, awaited without a thread; cancelled (or out of time), the request is."""
    with stream:
        await asyncio.wait_for(asyncio.wrap_future(stream.response), timeout)
        return stream.wait()
