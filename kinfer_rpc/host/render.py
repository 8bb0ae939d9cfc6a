"""Chat templates rendered in worker processes, so that no template can stall or take down the
server.

A model file's template is untrusted code. The sandbox (kinfer_rpc.host.templates) keeps it
away from Python's internals, but some operations finish only when the process runs out of time
or memory: string arithmetic done in C, loops over long strings, lipsum. So each render runs
in a worker process, which the server can kill:

- a render has RENDER_SECONDS (the environment's KINFER_RENDER_SECONDS overrides it); past that
  its worker is killed and the request fails with -32602 naming the limit;
- its output may be at most render_limit(request size) characters, and the worker's address space is
  capped while it renders, so a template that builds a huge string fails the same way;
- cancelling the request, unloading the model or the server's exit kill the worker at once;
- at most RENDER_WORKERS renders run at once (the others wait their turn), and none of them on
  the event loop: the protocol keeps answering while they run;
- the workers are shared in turns between clients (connections): a waiting render of the client
  running the fewest goes first, and while several clients are connected, no client takes the
  last free worker when every busy one is its own, so a client whose renders hang cannot keep
  another's waiting (its own later renders wait behind its hung ones);
- the workers run WORKER_NICE below the server: a spinning template takes the CPU only from
  what the server's own threads leave; a render still running after engine.IDLE_AFTER_SECONDS
  is moved to Linux's SCHED_IDLE (it runs only when nothing else wants the CPU, other renders included) and
  its worker is not reused.

Workers are started when first needed and reused; each is `python -m kinfer_rpc.host.render`,
reading one JSON request a line on stdin and answering one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from kinfer_rpc import errors
from kinfer_rpc.engine import IDLE_AFTER_SECONDS, on_idle_cpu

RENDER_SECONDS = float(os.environ.get("KINFER_RENDER_SECONDS", "10"))
RENDER_WORKERS = max(1, min(4, os.cpu_count() or 1))
WORKER_NICE = 10  # the render workers' niceness, added to the server's
# Why a worker could not start (it died before it said it was ready, or could not be spawned)
_START_ERRORS = (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, OSError)
_MEMORY_HEADROOM = 512 << 20  # address space a render may add to the worker's, beyond its input


def render_limit(request_bytes: int) -> int:
    """The most characters a render may produce for a request of that many bytes: the messages,
    whatever the template wraps around them, with room to spare."""
    return (1 << 20) + 4 * request_bytes


class _Worker:
    def __init__(self, process: Process):
        self.process = process
        assert process.stdout is not None and process.stdin is not None  # both PIPE
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)
        self.owner: object = None
        self.killed: str | None = None  # why, when it was killed while rendering
        self.demoted = False  # moved to SCHED_IDLE during a render: not reused

    def demote(self) -> None:
        """Run this worker only on CPU time nothing else wants."""
        if self.killed is None:
            self.demoted = on_idle_cpu(self.process.pid)

    @classmethod
    async def start(cls) -> _Worker:
        process = await anyio.open_process(
            [sys.executable, "-m", "kinfer_rpc.host.render"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the server's stderr: its log
            start_new_session=True,  # a terminal's Ctrl-C is the server's to handle, not the worker's
        )
        worker = cls(process)
        try:  # ready once it has imported the sandbox: the time limit is the render's alone
            await worker.stdout.receive_until(b"\n", 64)
        except BaseException:
            worker.kill("did not start")
            with anyio.CancelScope(shield=True):
                await process.aclose()
            raise
        return worker

    def kill(self, why: str) -> None:
        if self.killed is None:
            self.killed = why
        self.stop()

    def stop(self) -> None:
        """End the process, giving no reason (a demoted worker, retired after its render)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()


class _Turns:
    """Render workers handed out in turns between clients (Renderer's docstring says how)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.running: dict[int, int] = {}  # client -> renders it runs
        self.waiting: list[tuple[int, bool, anyio.Event]] = []  # (client, share, granted) in arrival order

    def _may(self, client: int, share: bool) -> bool:
        busy = sum(self.running.values())
        free = self.workers - busy
        mine = self.running.get(client, 0)
        return free > 0 and not (share and free == 1 and mine > 0 and mine == busy)

    def _grant(self) -> None:
        while True:
            fit = [w for w in self.waiting if self._may(w[0], w[1])]
            if not fit:
                return
            chosen = min(fit, key=lambda w: self.running.get(w[0], 0))  # the first of the fewest
            self.waiting.remove(chosen)
            self.running[chosen[0]] = self.running.get(chosen[0], 0) + 1
            chosen[2].set()

    def _release(self, client: int) -> None:
        self.running[client] -= 1
        if not self.running[client]:
            del self.running[client]
        self._grant()

    @contextlib.asynccontextmanager
    async def turn(self, client: int, share: bool) -> AsyncIterator[None]:
        entry = (client, share, anyio.Event())
        self.waiting.append(entry)
        self._grant()
        if not entry[2].is_set():
            try:
                await entry[2].wait()
            except BaseException:
                if entry in self.waiting:
                    self.waiting.remove(entry)
                else:  # granted as it was cancelled: the turn goes to the next
                    self._release(client)
                raise
        try:
            yield
        finally:
            self._release(client)


class Renderer:
    """The server's render workers."""

    def __init__(self, workers: int = RENDER_WORKERS, seconds: float = RENDER_SECONDS):
        self.seconds = seconds
        self._turns = _Turns(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False
        self._spare: asyncio.Task[None] | None = None  # a worker starting ahead of the render that needs it

    def _keep_a_spare(self) -> None:
        """Start a worker in the background when none is idle and another may run, so that the
        next render does not wait for a process to start (about 150 ms on two busy cores)."""
        if self._closed or self._idle or self._spare is not None or len(self._busy) >= self._turns.workers:
            return

        async def start() -> None:
            try:
                worker = await _Worker.start()
            except _START_ERRORS:
                return  # the render that needs it starts one and reports why it could not
            finally:
                self._spare = None
            if self._closed:
                worker.kill("closed")
                with anyio.CancelScope(shield=True):
                    await worker.process.aclose()
            else:
                self._idle.append(worker)

        self._spare = asyncio.get_running_loop().create_task(start())

    async def render(
        self,
        owner: object,
        template: str | None,
        messages: list[dict[str, Any]],
        *,
        bos: str = "",
        eos: str = "",
        tools: Any = None,
        variables: dict[str, Any] | None = None,
        client: int = 0,
        share: bool = False,
    ) -> str:
        """The template's prompt for these messages (`variables`: the switches a request sets).
        `owner` (the loaded model) is what stop() names to end its renders early; `client`: the
        connection that asked, `share`: whether several are connected (the turns)."""
        request = json.dumps(
            {
                "template": template,
                "messages": messages,
                "bos": bos,
                "eos": eos,
                "tools": tools,
                "variables": variables,
            },
            ensure_ascii=False,
        ).encode("utf-8", "surrogatepass")
        limit = render_limit(len(request))
        async with self._turns.turn(client, share):
            if self._closed:
                raise errors.KinferError(errors.INTERNAL_ERROR, "the server is exiting")
            try:
                worker = self._idle.pop() if self._idle else await _Worker.start()
            except _START_ERRORS as exc:
                raise errors.KinferError(errors.INTERNAL_ERROR, f"could not start a render worker: {exc!r}") from exc
            worker.owner = owner
            self._busy.add(worker)
            self._keep_a_spare()
            demotion = asyncio.get_running_loop().call_later(IDLE_AFTER_SECONDS, worker.demote)
            done = False
            try:
                with anyio.move_on_after(self.seconds):
                    await worker.stdin.send(request + b"\n")
                    answer = await worker.stdout.receive_until(b"\n", limit * 8 + 4096)  # JSON of UTF-8
                    done = True
                if not done:
                    worker.kill(f"the chat template took longer than the limit of {self.seconds:g} s to render")
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
                worker.kill("the chat template's render worker died (out of memory?)")
            except anyio.DelimiterNotFound:
                worker.kill(f"the chat template's prompt is over the limit of {limit} characters")
            except BaseException:  # cancelled: the render is stopped with its request
                worker.kill("cancelled")
                raise
            finally:
                demotion.cancel()
                self._busy.discard(worker)
                worker.owner = None
                if worker.killed is None and not self._closed and not worker.demoted:
                    self._idle.append(worker)
                else:
                    if self._closed:
                        worker.kill("closed")
                    else:  # killed already, or demoted: retired, its render stands
                        worker.stop()
                    with anyio.CancelScope(shield=True):
                        await worker.process.aclose()
            if worker.killed is not None:
                if worker.killed.startswith("the model"):  # stop(): its model was unloaded
                    raise errors.KinferError(errors.REQUEST_CANCELLED, worker.killed)
                if self._closed:  # aclose(): the server is exiting, whatever the render did
                    raise errors.KinferError(errors.INTERNAL_ERROR, "the server is exiting")
                raise errors.KinferError(errors.INVALID_PARAMS, worker.killed)  # a limit
        reply = json.loads(answer)
        if "error" in reply:
            raise errors.KinferError(reply["error"]["code"], reply["error"]["message"])
        text: str = reply["text"]
        return text

    def stop(self, owner: object, why: str = "the model was unloaded during its chat template's render") -> None:
        """End every render for `owner` now; each fails with `why`."""
        for worker in list(self._busy):
            if worker.owner is owner:
                worker.kill(why)

    async def aclose(self) -> None:
        """Kill every worker (the server is exiting)."""
        self._closed = True
        for worker in list(self._busy):
            worker.kill("the server is exiting")
        if self._spare is not None:  # it kills its worker itself, seeing the server closed
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._spare
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill("closed")
            with anyio.CancelScope(shield=True):
                await worker.process.aclose()


# -- the worker ----------------------------------------------------------------------------------
def _serve() -> None:
    # Below the server's threads, from the start (a spare worker imports while the server works):
    # a template that spins until its time limit takes the CPU only from what the machine does
    # not need (on a CPU, the engine's passes come first)
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    import resource

    from kinfer_rpc.host import templates

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    out.write(b"ready\n")
    out.flush()
    for line in inp:
        try:
            request = json.loads(line)
            limit = render_limit(len(line))
            base = _address_space()
            if base:
                soft = base + _MEMORY_HEADROOM + 16 * len(line)
                resource.setrlimit(resource.RLIMIT_AS, (soft if hard < 0 else min(soft, hard), hard))
            try:
                text = templates.render(
                    request["template"],
                    request["messages"],
                    bos=request["bos"],
                    eos=request["eos"],
                    tools=request["tools"],
                    max_chars=limit,
                    variables=request.get("variables"),
                )
            finally:
                if base:
                    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            answer: dict[str, Any] = {"text": text}
        except errors.KinferError as exc:
            answer = {"error": {"code": exc.code, "message": exc.message}}
        except MemoryError:
            answer = {"error": {"code": errors.INVALID_PARAMS, "message": "the chat template used too much memory"}}
        del line
        out.write(json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
        out.flush()


def _address_space() -> int:
    """This process's virtual memory size in bytes (0 where /proc cannot tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    _serve()
