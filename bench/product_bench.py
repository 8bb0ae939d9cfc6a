"""The product against its engine: whole-run tok/s through `kinfer-rpc` as clients run it, beside
kinfer's engine alone and llama-server on the same prompts, in one run.

    python bench/product_bench.py MODEL.gguf [--npl 32,128] [--ntg 64,256] [--npp 128]
        [--gpu-layers 999] [--clients python,raw] [--engine] [--llama-server PATH]
        [--temperature 0] [--trace DIR] [--rounds 1]

For each N in --npl and M in --ntg: N requests at once, each a distinct prompt of --npp tokens
(given as token ids, so every side reads exactly the same), M tokens each, end of generation
ignored, greedy unless --temperature says otherwise (seeded, one seed a request). Each side is
timed from its first request sent to its last reply, and `tps` is every generated token over
that time (the whole run: prompts, decoding, streaming every token to the client):

- `python`: kinfer's Python AsyncClient, streaming (a $/progress notification a step a request);
- `raw`: a minimal client on asyncio that writes frames and reads them back (JSON parsed, tokens
  counted), so the figure is the server's own;
- `engine`: kinfer's engine on its worker thread in this process, without the protocol
  (bench/harness.py's Run), loaded with the options the server loads with;
- `attach`: the raw client through `kinfer-rpc --attach` to a daemon (`kinfer serve`) the bench
  starts;
- `http`: OpenAI's `/v1/completions` on that daemon's HTTP face, streamed (the same token ids as
  the prompt, `ignore_eos`), through a minimal HTTP client that counts the usage it is sent;
- `rawchat`: the raw client's `inference/chat` on a kinfer-rpc of its own, one user message a
  request (its prompt's ids as text: about --npp tokens);
- `chat`: OpenAI's `/v1/chat/completions` on the daemon's HTTP face with the same messages,
  streamed (`ignore_eos`), through the minimal HTTP client;
- `llama-server`: llama.cpp's server with `-np N` (the same model, context per slot and flash
  attention), through that same HTTP client and endpoint (`cache_prompt` off); with `chat` among
  the clients, also its `/v1/chat/completions` with the same messages (`llama-server-chat`).

With --trace DIR the server runs with KINFER_TRACE, and each round of a kinfer client gets a
summary of where its time went (bench/trace_summary.py): time to first token, the prompt passes
and their sizes, queueing, the passes and the host work between them, and the client's own time.
One JSON line a case (bench/harness.py's format), then `ratio` lines: each side over the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from harness import distinct_prompts, emit, start_engine
from trace_summary import summarize

from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions


def kinfer_rpc_argv() -> list[str]:
    """The server as clients find it: $KINFER_RPC (a command line), the kinfer-rpc beside this
    Python, else `python -m kinfer_rpc`."""
    if os.environ.get("KINFER_RPC"):
        return shlex.split(os.environ["KINFER_RPC"])
    found = shutil.which("kinfer-rpc", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "kinfer_rpc"]


def options(ntg: int, temperature: float, i: int) -> dict[str, Any]:
    return {"maxTokens": ntg, "ignoreEos": True, "temperature": temperature, "seed": 1000 + i}


# -- a minimal JSON-RPC client over a pipe -----------------------------------------------------
class RawRpc:
    """Frames out, frames in, no more: what any client must at least do."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.progress: dict[str, int] = {}  # token -> tokens streamed
        self.first: dict[str, float] = {}  # token -> when its first piece came
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str]) -> RawRpc:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, limit=1 << 24
        )
        return cls(proc)

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        self.send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        return await future

    async def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = -1
            while True:
                line = await out.readline()
                if not line:
                    return
                if line in (b"\r\n", b"\n"):
                    break
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            message = json.loads(await out.readexactly(length))
            if "id" in message and "method" not in message:
                future = self.waiting.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif message.get("method") == "$/progress":
                params = message["params"]
                token = params["token"]
                self.progress[token] = self.progress.get(token, 0) + len(params["value"].get("tokens", ()))
                self.first.setdefault(token, time.perf_counter())

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.request("shutdown", {}), 30)
            self.send({"jsonrpc": "2.0", "method": "exit"})
            await asyncio.wait_for(self.proc.wait(), 30)
        except (TimeoutError, ConnectionError):
            self.proc.kill()
        self.reader.cancel()


async def raw_round(rpc: RawRpc, model: str, prompts: list[list[int]], ntg: int, temperature: float) -> dict[str, Any]:
    async def one(i: int, ids: list[int]) -> int:
        token = f"r{time.perf_counter_ns()}-{i}"
        params = {"model": model, "tokens": ids, "options": options(ntg, temperature, i), "partialResultToken": token}
        answer = await rpc.request("inference/generate", params)
        if "error" in answer:
            raise RuntimeError(f"request {i}: {answer['error']}")
        streamed = rpc.progress.pop(token, 0)
        rpc.first.pop(token, None)
        got = answer["result"]["usage"]["completionTokens"]
        if streamed != got:
            raise RuntimeError(f"request {i}: streamed {streamed} tokens of {got}")
        return int(got)

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "tokens": sum(tokens)}


async def python_round(
    client: Any, model: str, prompts: list[list[int]], ntg: int, temperature: float
) -> dict[str, Any]:
    from kinfer_rpc.client import AsyncStream

    async def one(i: int, ids: list[int]) -> int:
        stream = AsyncStream(
            client, "inference/generate", {"model": model, "tokens": ids, "options": options(ntg, temperature, i)}
        )
        async for _ in stream:
            pass
        result = stream.result
        assert result is not None
        return int(result.usage.completion_tokens)

    import anyio

    counts: list[int] = []
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):

            async def run(i: int = i, p: list[int] = p) -> None:
                counts.append(await one(i, p))

            tg.start_soon(run)
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "tokens": sum(counts)}


# -- llama-server through the same minimal client ------------------------------------------------
async def openai_stream(port: int, body: dict[str, Any], path: str = "/v1/completions") -> int:
    """One streamed OpenAI request (PATH) through a minimal HTTP client; the tokens its usage says."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
    data = json.dumps(body).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" % path.encode()
        + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data)
        + data
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{path} answered {status!r}: {(await reader.read(2000))!r}")
    tokens = 0
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    writer.close()
    return tokens


async def openai_round(port: int, model: str, prompts: list[list[int]], ntg: int, temperature: float) -> dict[str, Any]:
    def body(i: int, ids: list[int]) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": ids,
            "max_tokens": ntg,
            "temperature": temperature,
            "seed": 1000 + i,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"ignore_eos": True, "cache_prompt": False} if model == "llama-server" else {}),
        }

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(openai_stream(port, body(i, p)) for i, p in enumerate(prompts)))
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "tokens": sum(tokens)}


# -- chat: one user message a request, the prompt's ids as text ------------------------------------
CHAT_TEXT: dict[tuple[int, ...], str] = {}  # the prompts' ids -> their text (main_async fills it)


def chat_texts(model: str, prompts: list[list[int]]) -> None:
    """Each prompt's ids detokenized by the model's own vocabulary: a user message of about
    --npp tokens, distinct for each prompt, the same for every side."""
    import llama_cpp

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    for ids in prompts:
        n = len(ids)
        while True:  # a vocabulary of random pieces reads its text back as more tokens: fewer ids
            text = vocab.detokenize(ids[:n]).decode("utf-8", "replace")
            if n <= 1 or len(vocab.tokenize(text.encode(), add_bos=False, special=False)) <= len(ids):
                break
            n = n * 3 // 4
        CHAT_TEXT[tuple(ids)] = text


def chat_text(ids: list[int]) -> str:
    return CHAT_TEXT.get(tuple(ids)) or "Say something."


async def chat_round(port: int, model: str, prompts: list[list[int]], ntg: int, temperature: float) -> dict[str, Any]:
    def body(i: int, ids: list[int]) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": chat_text(ids)}],
            "max_tokens": ntg,
            "temperature": temperature,
            "seed": 1000 + i,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            **({"cache_prompt": False} if model == "llama-server" else {}),
        }

    t0 = time.perf_counter()
    tokens = await asyncio.gather(
        *(openai_stream(port, body(i, p), "/v1/chat/completions") for i, p in enumerate(prompts))
    )
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "tokens": sum(tokens)}


async def rawchat_round(
    rpc: RawRpc, model: str, prompts: list[list[int]], ntg: int, temperature: float
) -> dict[str, Any]:
    async def one(i: int, ids: list[int]) -> int:
        token = f"c{time.perf_counter_ns()}-{i}"
        messages = [{"role": "user", "content": chat_text(ids)}]
        params = {"model": model, "messages": messages, "options": options(ntg, temperature, i)}
        answer = await rpc.request("inference/chat", {**params, "partialResultToken": token})
        if "error" in answer:
            raise RuntimeError(f"request {i}: {answer['error']}")
        rpc.progress.pop(token, None)
        rpc.first.pop(token, None)
        return int(answer["result"]["usage"]["completionTokens"])

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "tokens": sum(tokens)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_llama_server(path: str, model: str, npl: int, ctx: int, gpu_layers: int) -> tuple[Any, int]:
    port = free_port()
    argv = [path, "-m", model, "-np", str(npl), "-c", str(ctx * npl), "-ngl", str(gpu_layers), "-fa", "on"]
    argv += ["--port", str(port), "--host", "127.0.0.1", "-b", "2048", "-ub", "512"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(argv)}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            await writer.drain()
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return proc, port
        except OSError:
            pass
        await asyncio.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not become healthy")


def stop(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        proc.kill()


# -- the engine alone ----------------------------------------------------------------------------
def engine_rounds(model: str, prompts: list[list[list[int]]], args: Any) -> list[tuple[int, dict[str, Any]]]:
    """kinfer's engine alone, loaded once for these prompts with the options the server loads
    with, warmed up as the servers are (one short request), then each --ntg in turn."""
    import threading

    from kinfer_rpc.default_plugins.llama import LlamaBackend
    from kinfer_rpc.protocol.options import load_request

    load, extra = load_request(load_params(args, len(prompts[0]))).resolve()
    engine = start_engine(
        lambda progress: LlamaBackend().load(model, load, progress),
        batch=load.batch,
        prefix=extra.prefix if extra.prefix is not None else load.slots * load.context_length,
    )

    def run(ps: list[list[int]], ntg: int) -> dict[str, Any]:
        finished = threading.Semaphore(0)
        jobs = [
            Job(
                list(p),
                GenerateOptions(
                    max_tokens=ntg,
                    ignore_eos=True,
                    sampling=SamplingOptions(temperature=args.temperature, seed=1000 + i),
                ),
                on_done=lambda j: finished.release(),
                on_piece=lambda text, toks: None,  # text is made for every token, as for a stream
            )
            for i, p in enumerate(ps)
        ]
        t0 = time.perf_counter()
        for job in jobs:
            engine.submit(job)
        for _ in jobs:
            finished.acquire()
        return {"t0": t0, "t1": time.perf_counter(), "tokens": sum(len(j.generated) for j in jobs)}

    rounds = []
    for ntg in args.ntg:
        run([prompts[0][0][:8]], 4)  # warm-up, as each server side's
        rounds += [(ntg, run(sets, ntg)) for sets in _sets(prompts, args, ntg)]
    engine.stop()
    return rounds


def _batches(prompts: list[list[int]], n: int) -> list[list[list[int]]]:
    return [prompts[i : i + n] for i in range(0, len(prompts), n)]


def _sets(prompts: list[list[list[int]]], args: Any, ntg: int) -> list[list[list[int]]]:
    """The prompt sets of the rounds of one --ntg value (each round its own)."""
    k = args.ntg.index(ntg)
    return prompts[k * args.rounds : (k + 1) * args.rounds]


def load_params(args: Any, npl: int) -> dict[str, Any]:
    return {"gpuLayers": args.gpu_layers, "slots": npl, "contextLength": args.npp + max(args.ntg) + 80}


# -- the run -------------------------------------------------------------------------------------
def figures(side: str, npl: int, ntg: int, r: dict[str, Any], args: Any) -> dict[str, Any]:
    wall = r["t1"] - r["t0"]
    out = {"side": side, "npl": npl, "npp": args.npp, "ntg": ntg, "temperature": args.temperature}
    out.update(tokens=r["tokens"], seconds=round(wall, 4), tps=round(r["tokens"] / wall, 1))
    return out


async def kinfer_rounds(args: Any, prompts_of: dict[int, list[list[list[int]]]], results: list[dict[str, Any]]) -> None:
    env = dict(os.environ)
    trace_file = None
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        trace_file = os.path.join(args.trace, "kinfer-trace.jsonl")
        if os.path.exists(trace_file):
            os.unlink(trace_file)
        env["KINFER_TRACE"] = trace_file
    daemon = Daemon(env) if {"attach", "http", "chat"} & set(args.clients) else None
    try:
        for npl in args.npl:
            prompts = prompts_of[npl]
            for side in args.clients:
                rounds = await _side_rounds(side, args, npl, prompts, env, daemon)
                for ntg, r in rounds:
                    rec = figures(side, npl, ntg, r, args)
                    if trace_file:
                        rec["trace"] = summarize(trace_file, r["t0"], r["t1"])
                    results.append(emit(f"{side}-{npl}x{ntg}", rec))
    finally:
        if daemon is not None:
            daemon.stop()


class Daemon:
    """`kinfer serve` with its HTTP faces, on a socket and a port of its own, for the attach and
    http sides (their models are unloaded after each round of requests at once)."""

    def __init__(self, env: dict[str, str]):
        self.home = tempfile.mkdtemp(prefix="kinfer-bench-")
        self.socket = os.path.join(self.home, "kinfer.sock")
        self.port = free_port()
        argv = [_kinfer(), "serve", "--socket", self.socket]
        argv += ["--http", f"127.0.0.1:{self.port}", "--keep-alive", "-1"]
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("kinfer serve did not start")
            time.sleep(0.05)

    def argv(self) -> list[str]:
        return [*kinfer_rpc_argv(), "--attach", "--socket", self.socket]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.home, ignore_errors=True)


def _kinfer() -> str:
    """The CLI as users find it: $KINFER, the kinfer beside this Python, else the one on PATH."""
    found = os.environ.get("KINFER") or shutil.which("kinfer", path=os.path.dirname(sys.executable))
    return found or "kinfer"


async def _side_rounds(
    side: str, args: Any, npl: int, prompts: list[list[int]], env: dict[str, str], daemon: Daemon | None
) -> list[tuple[int, dict[str, Any]]]:
    rounds: list[tuple[int, dict[str, Any]]] = []
    if side in ("raw", "attach", "http", "rawchat", "chat"):
        argv = daemon.argv() if side not in ("raw", "rawchat") and daemon is not None else kinfer_rpc_argv()
        rounder = {"http": openai_round, "chat": chat_round}.get(side)
        rpc = await RawRpc.spawn(argv, env)
        await rpc.request("initialize", {"processId": os.getpid(), "capabilities": {}})
        rpc.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        loaded = await rpc.request("model/load", {"model": args.model, "options": load_params(args, npl)})
        if "error" in loaded:
            raise RuntimeError(f"model/load: {loaded['error']}")
        name = loaded["result"]["model"]

        async def one_round(sets: list[list[int]], ntg: int) -> dict[str, Any]:
            if rounder is not None:
                assert daemon is not None
                return await rounder(daemon.port, name, sets, ntg, args.temperature)
            return await (rawchat_round if side == "rawchat" else raw_round)(rpc, name, sets, ntg, args.temperature)

        for ntg in args.ntg:
            await one_round([prompts[0][0][:8]], 4)  # warm-up
            for sets in _sets(prompts, args, ntg):
                rounds.append((ntg, await one_round(sets, ntg)))
        if side not in ("raw", "rawchat"):  # the daemon keeps it: the next round loads with other slots
            await rpc.request("model/unload", {"model": name})
        await rpc.close()
        return rounds
    from kinfer_rpc.client import AsyncClient

    async with AsyncClient(kinfer_rpc_argv(), env=env) as client:
        loaded_model = await client.load(args.model, **load_params(args, npl))
        await python_round(client, loaded_model.model, [prompts[0][0][:8]], 4, 0.0)  # warm-up
        for ntg in args.ntg:
            for sets in _sets(prompts, args, ntg):
                rounds.append((ntg, await python_round(client, loaded_model.model, sets, ntg, args.temperature)))
    return rounds


async def main_async(args: Any) -> None:
    from kinfer_rpc.host import gguf

    vocab = gguf.read(args.model).n_vocab or 32000
    # Every round of every side its own prompts (the k-th round of each side the same), so that no
    # side reads a prompt it read before: the prefix pool would serve it.
    count = len(args.ntg) * args.rounds
    prompts_of = {
        npl: [list(p) for p in _batches(distinct_prompts(npl * count, args.npp, vocab), npl)] for npl in args.npl
    }
    if {"chat", "rawchat"} & set(args.clients):
        chat_texts(args.model, [p for sets in prompts_of.values() for batch in sets for p in batch])
    results: list[dict[str, Any]] = []
    if args.engine:
        for npl in args.npl:
            for ntg, r in engine_rounds(args.model, prompts_of[npl], args):
                results.append(emit(f"engine-{npl}x{ntg}", figures("engine", npl, ntg, r, args)))
    await kinfer_rounds(args, prompts_of, results)
    if args.llama_server:
        for npl in args.npl:
            try:
                proc, port = await start_llama_server(
                    args.llama_server, args.model, npl, args.npp + max(args.ntg) + 80, args.gpu_layers
                )
            except Exception as exc:  # the anchor failed: kinfer's figures still stand
                emit(f"llama-server-{npl}", {"side": "llama-server", "npl": npl, "error": str(exc)})
                continue
            try:
                await openai_round(port, "llama-server", [prompts_of[npl][0][0][:8]], 4, 0.0)  # warm-up
                for ntg in args.ntg:
                    for sets in _sets(prompts_of[npl], args, ntg):
                        r = await openai_round(port, "llama-server", sets, ntg, args.temperature)
                        results.append(emit(f"llama-server-{npl}x{ntg}", figures("llama-server", npl, ntg, r, args)))
                        if "chat" in args.clients:
                            r = await chat_round(port, "llama-server", sets, ntg, args.temperature)
                            side = "llama-server-chat"
                            results.append(emit(f"{side}-{npl}x{ntg}", figures(side, npl, ntg, r, args)))
            except Exception as exc:
                emit(
                    f"llama-server-{npl}", {"side": "llama-server", "npl": npl, "error": f"{type(exc).__name__}: {exc}"}
                )
            finally:
                stop(proc)
    # each side over the engine (medians over rounds), and kinfer's clients over llama-server
    by: dict[tuple[str, int, int], list[float]] = {}
    for rec in results:
        by.setdefault((rec["side"], rec["npl"], rec["ntg"]), []).append(rec["tps"])
    med = {k: sorted(v)[len(v) // 2] for k, v in by.items()}
    for (side, npl, ntg), tps in sorted(med.items()):
        ratio: dict[str, Any] = {"side": side, "npl": npl, "ntg": ntg, "tps": tps}
        if side != "engine" and ("engine", npl, ntg) in med:
            ratio["over_engine"] = round(tps / med[("engine", npl, ntg)], 3)
        if side in ("python", "raw") and ("llama-server", npl, ntg) in med:
            ratio["over_llama_server"] = round(tps / med[("llama-server", npl, ntg)], 3)
        if side in ("chat", "rawchat") and ("llama-server-chat", npl, ntg) in med:
            ratio["over_llama_server_chat"] = round(tps / med[("llama-server-chat", npl, ntg)], 3)
        if side == "chat" and ("rawchat", npl, ntg) in med:
            ratio["over_stdio_chat"] = round(tps / med[("rawchat", npl, ntg)], 3)
        if side in ("attach", "http") and ("raw", npl, ntg) in med:
            ratio["over_raw"] = round(tps / med[("raw", npl, ntg)], 3)
        if len(ratio) > 4:
            emit("ratio", ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--npl", default="32,128", help="requests at once, comma-separated")
    ap.add_argument("--ntg", default="64,256", help="tokens a request, comma-separated")
    ap.add_argument("--npp", type=int, default=128, help="prompt tokens a request")
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument(
        "--clients",
        default="python,raw",
        help="kinfer's sides, comma-separated: python, raw, rawchat (each a kinfer-rpc of its own); attach (the "
        "raw client through kinfer-rpc --attach to a daemon), http (OpenAI's /v1/completions, streamed, on the "
        "daemon's HTTP face) and chat (its /v1/chat/completions; llama-server's too)",
    )
    ap.add_argument("--engine", action="store_true", help="also kinfer's engine alone")
    ap.add_argument("--llama-server", default=None, help="also this llama-server binary with -np N")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--trace", default=None, help="a folder: the server's trace, summarized per round")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    args.npl = [int(x) for x in args.npl.split(",") if x]
    args.ntg = [int(x) for x in args.ntg.split(",") if x]
    args.clients = [c for c in args.clients.split(",") if c]
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
