"""The servers: the daemon (`kinfer serve`, `stop`), `kinfer ps`, `bench` and `rpc-server`."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from kinfer_rpc.cli.common import _load_options, _server
from kinfer_rpc.cli.output import _bar, _emit, _fill, _human, _table, err, out
from kinfer_rpc.client import (
    AsyncClient,
)
from kinfer_rpc.client import Progress as WorkProgress
from kinfer_rpc.terminal import columns


def _ended(pid: int) -> bool:
    """Whether the process has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2 :].startswith("Z")
    except (ProcessLookupError, FileNotFoundError):
        return True
    except (OSError, ValueError):
        return False


def _serve(args: argparse.Namespace) -> int:
    from kinfer_rpc.protocol import daemon

    return daemon.run(args)


def _stop(args: argparse.Namespace) -> int:
    """SIGTERM to the daemon (its pid from the socket's peer credentials), then wait for it."""
    import signal
    import socket
    import struct

    from kinfer_rpc.protocol.rendezvous import default_socket

    path = args.socket or str(default_socket())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            print(f"no kinfer daemon answers on {path}")
            return 0 if not os.path.exists(path) else 1
        pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _ended(pid):
            print(f"stopped the kinfer daemon (pid {pid}) on {path}")
            return 0
        time.sleep(0.05)
    err.print(f"kinfer: the daemon (pid {pid}) did not stop within 30 s")
    return 1


# -- ps ----------------------------------------------------------------------------------------
def _is_server(argv: list[str]) -> bool:
    """kinfer-rpc (standalone, or attached to the daemon) and the daemon (`kinfer serve`)."""
    head = [os.path.basename(a) for a in argv[:2]]
    if "kinfer-rpc" in head:
        return True
    if "kinfer" in head and "serve" in argv[head.index("kinfer") + 1 : head.index("kinfer") + 2]:
        return True
    return any(a == "-m" and b in ("kinfer_rpc", "kinfer_rpc.protocol.daemon") for a, b in zip(argv, argv[1:]))


def _state(status: dict[str, Any] | None) -> str | None:
    """busy (requests running), loading (a model is), idle (neither); None without a status file."""
    if status is None:
        return None
    models = [m for m in status.get("models") or [] if isinstance(m, dict)]
    if status.get("requestsRunning") or any(m.get("slotsBusy") or m.get("queued") for m in models):
        return "busy"
    if any(m.get("state") == "loading" for m in models):
        return "loading"
    return "idle"


def _servers() -> list[dict[str, Any]]:
    """kinfer-rpc processes on this machine, from /proc. What a server holds is its own (it
    answers only its client), so the models are read from what it has mapped: the model files;
    what it is doing, from the status file each server keeps ($KINFER_HOME/run/<pid>.json)."""
    from kinfer_rpc.host import status as server_status
    from kinfer_rpc.host.store import ModelStore

    names = {r.path: r.name for r in ModelStore().list()}
    statuses = server_status.read_all()
    try:
        hz = os.sysconf("SC_CLK_TCK")
        boot = float(open("/proc/stat").read().split("btime ")[1].split()[0])
    except Exception:
        hz, boot = 100, None
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")[:-1]
            if not argv or not _is_server(argv):
                continue
            stat = open(f"/proc/{pid}/stat").read()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z":
                continue
            ppid = int(fields[1])
            started = boot + int(fields[19]) / hz if boot else None
            rss = 0
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            paths = []
            try:
                for line in open(f"/proc/{pid}/maps"):
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        path = parts[5].strip()
                        if (path.endswith(".gguf") or path.endswith(".safetensors")) and path not in paths:
                            paths.append(path)
            except OSError:
                pass
            try:
                client = open(f"/proc/{ppid}/comm").read().strip()
            except OSError:
                client = None
            client_pid = None
            if "--clientProcessId" in argv:
                i = argv.index("--clientProcessId")
                if i + 1 < len(argv) and argv[i + 1].isdigit():
                    client_pid = int(argv[i + 1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        status = statuses.get(pid)
        if status is not None and started and float(status.get("startedAt") or 0) < started - 5:
            status = None  # an earlier process's, with the same pid
        models: list[dict[str, Any]] = [{"name": names.get(p, os.path.basename(p)), "path": p} for p in paths]
        for m in (status or {}).get("models") or []:
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                continue
            held = next((x for x in models if x["name"] == m["name"]), None)
            if held is None:
                held = {"name": m["name"], "path": None}  # loading: not mapped yet
                models.append(held)
            held.update(
                {k: m.get(k) for k in ("state", "slotsBusy", "slots", "queued", "holders", "pinned", "expiresIn")}
            )
        found.append(
            {
                "pid": pid,
                "ppid": ppid,
                "client": client,
                "clientProcessId": client_pid,
                "uptimeSeconds": round(time.time() - started, 1) if started else None,
                "rssBytes": rss,
                "state": _state(status),
                "requestsRunning": status.get("requestsRunning") if status else None,
                "models": models,
                "command": argv,
                # the daemon's socket and open connections; a proxy attached to it holds nothing itself
                "daemon": status.get("daemon") if status else None,
                "attached": "--attach" in argv,
            }
        )
    return sorted(found, key=lambda s: s["pid"])


def _ps(args: argparse.Namespace) -> int:
    servers = _servers()
    if args.json:
        _emit(servers)
        return 0
    if not servers:
        print(_fill("no kinfer-rpc is running on this machine (each client spawns its own; `kinfer serve` shares one)"))
        return 0

    def uptime(s: dict[str, Any]) -> str:
        u = s["uptimeSeconds"]
        return "-" if u is None else f"{u:.0f}s" if u < 120 else f"{u / 60:.0f}m" if u < 7200 else f"{u / 3600:.1f}h"

    def model(m: dict[str, Any]) -> str:
        if m.get("state") in ("loading", "failed"):
            return f"{m['name']} ({m['state']})"
        if m.get("slots"):
            notes = [f"{m.get('slotsBusy') or 0}/{m['slots']} busy"]
            if m.get("holders"):
                notes.append(f"{m['holders']} held")
            if m.get("pinned"):
                notes.append("pinned")
            elif m.get("expiresIn") is not None:
                notes.append(f"unloads in {m['expiresIn']:.0f}s")
            return f"{m['name']} ({', '.join(notes)})"
        return str(m["name"])

    def client(s: dict[str, Any]) -> str:
        if s.get("daemon"):
            n = s["daemon"].get("connections", 0)
            return f"daemon ({n} connection{'s' if n != 1 else ''})"
        return f"{s['client'] or '?'} ({s['ppid']})"

    for s in servers:
        if s.get("daemon"):
            socket_path = columns.home_short(str(s["daemon"].get("socket")))
            print(_fill(f"the kinfer daemon (pid {s['pid']}) listens on {socket_path}; kinfer uses it"))
        elif s.get("attached"):
            s["state"] = "attached"  # a proxy: its models and requests are the daemon's
    _table(
        ["PID", "CLIENT", "UPTIME", "RSS", "STATE", "REQUESTS", "MODELS"],
        [
            [
                str(s["pid"]),
                client(s),
                uptime(s),
                _human(s["rssBytes"], [" B", " KB", " MB", " GB", " TB"]),
                s["state"] or "-",
                "-" if s["requestsRunning"] is None else str(s["requestsRunning"]),
                ", ".join(model(m) for m in s["models"]) or "-",
            ]
            for s in servers
        ],
        right={5},
        elastic=6,
        wide=args.wide,
        drop=False,
        middle=False,
    )
    return 0


# -- bench -------------------------------------------------------------------------------------
async def _bench_async(args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    messages = [{"role": "user", "content": args.prompt}]
    options: dict[str, Any] = {"maxTokens": args.max_tokens, "ignoreEos": True}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    load_options = _load_options(args)
    load_options.setdefault("slots", max(4, args.concurrency))
    runs: list[dict[str, float]] = []
    async with AsyncClient(_server(args)) as kinfer:
        with _bar(transient=False, quiet=args.json) as bar:
            loading = bar.add_task(f"loading {args.model or 'the default model'}", total=100)

            def on_progress(p: WorkProgress) -> None:
                if p.percentage is not None:
                    bar.update(loading, completed=p.percentage)
                if p.kind == "end":
                    bar.update(loading, completed=100)

            t0 = time.perf_counter()
            loaded = await kinfer.load(args.model, progress=on_progress, **load_options)
            load_s = time.perf_counter() - t0
            task = bar.add_task(
                f"bench {args.requests}×{args.max_tokens} tokens, {args.concurrency} at once",
                total=args.requests * args.max_tokens,
            )
            limiter = anyio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with limiter:
                    start = time.perf_counter()
                    first = None
                    async with kinfer.stream_chat(messages, loaded.model, seed=args.seed + i, **options) as stream:
                        async for _piece in stream:
                            if first is None:
                                first = time.perf_counter()
                        assert stream.result is not None  # set when the stream ran to its end
                        result = stream.result
                    end = time.perf_counter()
                    bar.update(task, advance=result.usage.completion_tokens)
                    runs.append(
                        {
                            "ttftMs": ((first or end) - start) * 1000,
                            "latencyMs": (end - start) * 1000,
                            "promptTokens": result.usage.prompt_tokens,
                            "completionTokens": result.usage.completion_tokens,
                            "tokensPerSecond": result.timings.tokens_per_second,
                        }
                    )

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(args.requests):
                    tg.start_soon(one, i)
            wall = time.perf_counter() - t0
            status = (await kinfer.status(loaded.model))[0]
    completion = sum(r["completionTokens"] for r in runs)

    def mean(key: str) -> float:
        return round(sum(r[key] for r in runs) / len(runs), 2) if runs else 0.0

    return {
        "model": loaded.model,
        "backend": loaded.backend,
        "slots": status.slots,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "maxTokens": args.max_tokens,
        "loadSeconds": round(load_s, 3),
        "wallSeconds": round(wall, 3),
        "promptTokens": sum(r["promptTokens"] for r in runs),
        "completionTokens": completion,
        "tokensPerSecond": round(completion / wall, 2) if wall > 0 else 0.0,
        "perRequest": {
            "tokensPerSecondMean": mean("tokensPerSecond"),
            "ttftMsMean": mean("ttftMs"),
            "ttftMsMax": round(max((r["ttftMs"] for r in runs), default=0.0), 2),
            "latencyMsMean": mean("latencyMs"),
        },
    }


def _bench(args: argparse.Namespace) -> int:
    import anyio

    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        err.print("kinfer bench: --requests, --concurrency and --max-tokens must be at least 1")
        return 2
    report = anyio.run(_bench_async, args)
    if args.json:
        _emit(report)
        return 0
    r, p = report, report["perRequest"]
    out.print(f"[bold]{r['model']}[/bold] ({r['backend']}, {r['slots']} slots), loaded in {r['loadSeconds']:.2f} s")
    out.print(
        f"{r['requests']} requests, {r['concurrency']} at once: "
        f"{r['completionTokens']} tokens in {r['wallSeconds']:.2f} s"
    )
    out.print(f"throughput      [bold green]{r['tokensPerSecond']:.1f} tok/s[/bold green]")
    out.print(f"per request     {p['tokensPerSecondMean']:.1f} tok/s, latency {p['latencyMsMean']:.0f} ms")
    out.print(f"first token     {p['ttftMsMean']:.0f} ms mean, {p['ttftMsMax']:.0f} ms max")
    return 0
