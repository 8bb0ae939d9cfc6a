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
  the event loop: the protocol keeps answering while they run.

Workers are started when first needed and reused; each is `python -m kinfer_rpc.host.render`,
reading one JSON request a line on stdin and answering one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from kinfer_rpc import errors

RENDER_SECONDS = float(os.environ.get("KINFER_RENDER_SECONDS", "10"))
RENDER_WORKERS = max(1, min(4, os.cpu_count() or 1))
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
        try:
            self.process.kill()
        except ProcessLookupError:
            pass


class Renderer:
    """The server's render workers."""

    def __init__(self, workers: int = RENDER_WORKERS, seconds: float = RENDER_SECONDS):
        self.seconds = seconds
        self._slots = anyio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

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
    ) -> str:
        """The template's prompt for these messages (`variables`: the switches a request sets).
        `owner` (the loaded model) is what stop() names to end its renders early."""
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
        async with self._slots:
            if self._closed:
                raise errors.KinferError(errors.INTERNAL_ERROR, "the server is exiting")
            try:
                worker = self._idle.pop() if self._idle else await _Worker.start()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, OSError) as exc:
                raise errors.KinferError(errors.INTERNAL_ERROR, f"could not start a render worker: {exc!r}") from exc
            worker.owner = owner
            self._busy.add(worker)
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
                self._busy.discard(worker)
                worker.owner = None
                if worker.killed is None and not self._closed:
                    self._idle.append(worker)
                else:
                    worker.kill("closed")
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
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill("closed")
            with anyio.CancelScope(shield=True):
                await worker.process.aclose()


# -- the worker ----------------------------------------------------------------------------------
def _serve() -> None:
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
