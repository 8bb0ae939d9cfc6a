"""What every `kinfer` command shares: the server it talks to, and loading a model."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kinfer_rpc.cli.output import _bar, err
from kinfer_rpc.client import (
    Client,
    LoadedModel,
    server_command,
)
from kinfer_rpc.client import Progress as WorkProgress


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
    if getattr(args, "projector", None) is not None:
        options["projector"] = os.path.abspath(os.path.expanduser(args.projector))
    return options


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

        options = _load_options(args)
        loaded = kinfer.load(model, progress=on_progress, **options)
    asked = options.get("contextLength")
    if asked is not None and loaded.context_length and loaded.context_length != asked:
        # the backend rounds a context (llama.cpp: up to 256 cells at least): said once, at the load
        actual = loaded.context_length
        why = f"below the least the {loaded.backend} backend gives" if actual > asked else "more than it can have"
        err.print(
            f"kinfer: note: a context length of {asked} is {why}: {loaded.model} runs with {actual} tokens a slot",
            markup=False,
            highlight=False,
        )
    return loaded


# -- the server: the daemon when one runs -------------------------------------------------------
def _server(args: argparse.Namespace) -> list[str]:
    """The command the CLI's client runs: `kinfer-rpc --attach` when the daemon answers (every
    kinfer then shares its models, as `ollama run` talks to `ollama serve`), else a kinfer-rpc
    of its own; with the log level asked for (llama.cpp's warnings are the server's log)."""
    from kinfer_rpc.protocol.rendezvous import default_socket, live

    command = [*server_command(), "--log-level", args.log_level]
    try:
        running = live(default_socket(), timeout=1.0)
    except OSError:
        running = False
    return [*command, "--attach"] if running else command
