"""`kinfer`'s argument parser and entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from kinfer_rpc import __version__
from kinfer_rpc.cli.chat import _chat, _format_arg, _option_arg, _think_arg, _tool_arg
from kinfer_rpc.cli.doctor import _doctor, _rpc_server, _setup
from kinfer_rpc.cli.models import _embed, _list, _pull, _rm, _show
from kinfer_rpc.cli.output import _emit, _fail, _rpc_failure
from kinfer_rpc.cli.servers import _bench, _ps, _serve, _stop
from kinfer_rpc.client import (
    RpcError,
)
from kinfer_rpc.terminal import advice
from kinfer_rpc.terminal import config as config_file
from kinfer_rpc.terminal import options as request_options
from kinfer_rpc.terminal.completion import SHELLS
from kinfer_rpc.terminal.completion import script as completion_script


# -- main --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors give the closest spelling of a misspelt command, and with
    --json are a JSON document on stdout too."""

    json_errors = False  # --json is among the words

    def error(self, message: str) -> NoReturn:
        message = _closest_choice(message)
        if _Parser.json_errors:
            _emit(advice.Advice(message, (f"`{self.prog} --help` lists what it takes",)).json(2))
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _closest_choice(message: str) -> str:
    """argparse's "invalid choice: 'lst' (choose from ...)" with the choice meant, if one is close."""
    import re

    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not found:
        return message
    word, choices = found.group(1), re.findall(r"'([^']*)'", found.group(2))
    hint = advice.did_you_mean(word, choices)
    if message.startswith("argument COMMAND"):
        return f"unknown command {word!r}." + (hint or f" Commands: {', '.join(choices)}")
    return f"{message[: found.start()]}{word!r} is not one of {', '.join(choices)}.{hint}"


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings]


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `kinfer` argument parser, and its commands' parsers by name (completion reads both)."""
    parser = _Parser(prog="kinfer", description="kinfer-rpc for people: chat with local models, pull and list them")
    parser.add_argument("--json", action="store_true", help="machine-readable output (one JSON document per line)")
    parser.add_argument(
        "--log-level",
        default=None,
        choices=config_file.LOG_LEVELS,
        help="what the server logs on stderr (default: the config file's, else error)",
    )
    parser.add_argument("--version", action="version", version=f"kinfer {__version__}")
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    common.add_argument(
        "--log-level", default=argparse.SUPPRESS, choices=config_file.LOG_LEVELS, help="what the server logs on stderr"
    )
    loading = _Parser(add_help=False)
    loading.add_argument("--threads", type=int, default=None, help="CPU threads for the model")
    loading.add_argument("--gpu-layers", type=int, default=None, help="layers to offload (-1: all)")
    loading.add_argument("--context-length", type=int, default=None, help="context per slot")
    loading.add_argument(
        "--projector",
        default=None,
        metavar="FILE",
        help="the model's vision projector (mmproj GGUF): a prompt's image paths are then read",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    talking = _Parser(add_help=False)  # chat and run
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
        help="hold the reply to the JSON schema in FILE, or to any JSON object (json)",
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
    talking.add_argument(
        "-o",
        "--option",
        dest="options",
        nargs=2,
        action="append",
        metavar=("NAME", "VALUE"),
        help="any request option: -o top_k 20, -o num_predict 64, -o stop END (repeatable)",
    )
    talking.add_argument(
        "--think",
        type=_think_arg,
        default=None,
        metavar="[=LEVEL]",
        help="a thinking model reasons first: --think, --think=high (low, medium), --think=false",
    )
    talking.add_argument(
        "--hidethinking", action="store_true", help="don't show a thinking model's reasoning (it still reasons)"
    )
    talking.add_argument("-v", "--verbose", action="store_true", help="timings after each reply, as Ollama's")
    talking.add_argument(
        "--nowordwrap", action="store_true", help="don't wrap replies at words (at a terminal they are by default)"
    )

    chat = sub.add_parser(
        "chat", parents=[common, loading, talking], help="chat with a model (interactive without a prompt)"
    )
    chat.add_argument(
        "-m", "--model", default=None, help="model name or path (default: the config file's, else the embedded SmolLM2)"
    )
    chat.add_argument("prompt", nargs="?", default=None, help="one question; without it the chat is interactive")
    run = sub.add_parser(
        "run", parents=[common, loading, talking], help="chat with the model NAME (interactive without a prompt)"
    )
    run.add_argument("-m", "--model", dest="model_option", metavar="NAME", help="the model, as chat takes it")
    run.add_argument(
        "model",
        metavar="NAME",
        nargs="?",
        default=None,
        help="model name (as Ollama names it, or a prefix) or path",
    )
    run.add_argument("prompt", nargs="*", help="one question (its words); without it the chat is interactive")

    listing = sub.add_parser("list", parents=[common], help="list the models this machine can serve")
    listing.add_argument("--wide", action="store_true", help="every column, paths whole")
    ps = sub.add_parser("ps", parents=[common], help="kinfer-rpc processes on this machine and the models they hold")
    ps.add_argument("--wide", action="store_true", help="the models' column whole")
    show = sub.add_parser(
        "show", parents=[common], help="what a model is: its header, parameters, template, system, license"
    )
    show.add_argument("model", metavar="NAME", help="model name (as Ollama names it, or a prefix) or path")
    part = show.add_mutually_exclusive_group()
    for flag in ("template", "system", "parameters", "license"):
        part.add_argument(f"--{flag}", dest="part", action="store_const", const=flag, help=f"only the {flag}")

    bench = sub.add_parser("bench", parents=[common, loading], help="run concurrent chats and report tokens per second")
    bench.add_argument("-m", "--model", default=None)
    bench.add_argument("-n", "--requests", type=int, default=8)
    bench.add_argument("-c", "--concurrency", type=int, default=4)
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per request (end of text is ignored)")
    bench.add_argument("--slots", type=int, default=None, help="slots to load with (default: max(4, concurrency))")
    bench.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    bench.add_argument("--temperature", type=float, default=None)
    bench.add_argument("--seed", type=int, default=1)

    embed = sub.add_parser(
        "embed", parents=[common], help="embed texts with an embedding model: one vector a line (or --json)"
    )
    embed.add_argument("-m", "--model", default=None, help="an embedding model's name or path")
    embed.add_argument("--dimensions", type=int, default=None, help="cut each vector to this size (Matryoshka models)")
    embed.add_argument("--raw", action="store_true", help="the vectors as the model pools them, not normalized")
    embed.add_argument("texts", metavar="TEXT", nargs="*", help="texts to embed (none: stdin is one text)")

    doctor = sub.add_parser("doctor", parents=[common], help="backends, devices, memory and the default model")
    doctor.add_argument("--no-load", dest="load", action="store_false", help="skip loading the default model")

    pull = sub.add_parser(
        "pull", parents=[common], help="download a model from Ollama's registry or Hugging Face (hf.co/ORG/REPO:QUANT)"
    )
    pull.add_argument(
        "model", metavar="NAME", help="qwen3:0.6b, alice/tool:v1, host/ns/model:tag or hf.co/ORG/REPO:QUANT"
    )
    pull.add_argument(
        "--registry", default=None, help="Ollama's registry (default: $KINFER_REGISTRY or https://registry.ollama.ai)"
    )
    pull.add_argument(
        "--hf-endpoint", default=None, help="Hugging Face (default: $KINFER_HF_ENDPOINT or https://huggingface.co)"
    )
    pull.add_argument("--insecure", action="store_true", help="http instead of https for a registry named in NAME")
    rm = sub.add_parser("rm", parents=[common], help="delete models pulled into kinfer's folder (never Ollama's)")
    rm.add_argument("models", metavar="NAME", nargs="+", help="a model's name as `kinfer list` shows it")

    serve = sub.add_parser(
        "serve",
        help="run the daemon: one warm runtime that editors (kinfer-rpc --attach), agents and kinfer share",
    )
    from kinfer_rpc.protocol import daemon as daemon_module

    daemon_module.add_arguments(serve)
    stop = sub.add_parser("stop", help="stop the daemon (answering what it is doing with an error)")
    stop.add_argument("--socket", default=None, help="the daemon's socket (default: the default socket)")

    rpc = sub.add_parser(
        "rpc-server",
        parents=[common],
        help="serve this host's devices to kinfer-rpc on another host (llama.cpp's RPC server)",
    )
    rpc.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    rpc.add_argument("--port", "-p", type=int, default=50052)
    rpc.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: half the cores)")
    rpc.add_argument("--device", "-d", default=None, help="devices to serve, comma-separated (default: all)")
    rpc.add_argument("--cache", "-c", action="store_true", help="keep received tensors in a local file cache")

    setup = sub.add_parser(
        "setup",
        parents=[common],
        help="build kinfer's llama.cpp (CUDA where nvcc is found) into $KINFER_HOME/llama/lib; kinfer then loads it",
    )
    where = setup.add_mutually_exclusive_group()
    where.add_argument("--cuda", dest="cuda", action="store_true", default=None, help="with CUDA (needs nvcc)")
    where.add_argument("--cpu", dest="cuda", action="store_false", help="for the CPU only")
    setup.add_argument("--source", default=None, help="llama.cpp's source (a folder or .tgz) instead of PyPI's sdist")

    completion = sub.add_parser(
        "completion", help="the shell completion script (bash, zsh, fish): source <(kinfer completion bash)"
    )
    completion.add_argument("shell", nargs="?", choices=SHELLS, help="bash, zsh or fish")
    completion.add_argument("--models", action="store_true", help=argparse.SUPPRESS)  # the names, for the scripts
    return parser, dict(sub.choices)


def _completion(args: argparse.Namespace) -> int:
    """`kinfer completion SHELL`: the script; `--models`: model names, one a line, read from the
    stores without a server (the scripts call it)."""
    if args.models:
        from kinfer_rpc.host.store import ModelStore

        try:
            names = sorted({r.name for r in ModelStore().list()})
        except Exception:  # noqa: BLE001 - completion offers nothing rather than a traceback
            names = []
        print("\n".join(names))
        return 0
    if args.shell is None:
        args.parser.error("completion: which shell? kinfer completion bash, zsh or fish")
    parser, _ = build_parser()
    names = list(request_options.SHOWN.values())
    sys.stdout.write(completion_script(args.shell, parser, names))
    return 0


def _apply_config(args: argparse.Namespace, cfg: config_file.Config) -> None:
    """The config file's defaults, where the command line gave none."""
    if getattr(args, "log_level", None) is None:
        args.log_level = cfg.log_level or "error"
    if args.command in ("chat", "bench") and args.model is None:
        args.model = cfg.model
    for attr in ("threads", "gpu_layers", "context_length"):
        if hasattr(args, attr) and getattr(args, attr) is None:
            setattr(args, attr, getattr(cfg, attr))
    if args.command in ("chat", "run"):
        args.verbose = args.verbose or bool(cfg.verbose)
        args.wordwrap = not args.nowordwrap and cfg.wordwrap is not False


def _talking_arguments(args: argparse.Namespace, command: argparse.ArgumentParser) -> None:
    """run's model (first, or -m) and its prompt (the words after it, joined as Ollama joins them)."""
    if args.command != "run":
        return
    words = ([args.model] if args.model is not None else []) + list(args.prompt)
    if args.model_option is not None:
        args.model = args.model_option
    elif words:
        args.model = words.pop(0)
    else:
        command.error("which model? kinfer run NAME [PROMPT] (or -m NAME); `kinfer list` shows them")
    args.prompt = " ".join(words) if words else None


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # --think alone is --think=true: its level goes after "=", as Ollama's, so that the words after
    # it stay the prompt's
    words = ["--think=true" if w == "--think" else w for w in words]
    _Parser.json_errors = "--json" in words
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(words)
    if args.command is None:  # `kinfer` alone: what it can do
        parser.print_help()
        return 0
    command = commands[args.command]
    args.parser = command
    if args.command == "run":  # words after an option are the prompt's too (argparse leaves them over)
        args.prompt += [e for e in extra if not e.startswith("-")]
        extra = [e for e in extra if e.startswith("-")]
    if extra:
        known = _option_strings(command) + _option_strings(parser)
        hints = "".join(advice.did_you_mean(e.split("=", 1)[0], known) for e in extra if e.startswith("-"))
        if args.command == "chat" and not any(e.startswith("-") for e in extra):
            command.error(
                f"unrecognized arguments: {' '.join(extra)} (one prompt, in quotes; the model is -m NAME, "
                "or `kinfer run NAME PROMPT`)"
            )
        command.error(f"unrecognized arguments: {' '.join(extra)}.{hints}".replace("..", ".").rstrip("."))
    if args.command in ("completion", "serve"):  # neither reads the config file
        return _completion(args) if args.command == "completion" else _serve(args)
    try:
        cfg = config_file.read()
    except config_file.ConfigError as exc:
        steps = ('Fix or remove the file; docs/cli.md\'s "The config file" says what it takes.',)
        _fail(args, advice.Advice(str(exc), steps))
        return 2
    _talking_arguments(args, command)
    _apply_config(args, cfg)
    if args.command in ("chat", "run"):
        try:
            args.request_options = _option_arg(args, cfg.options)
        except request_options.OptionError as exc:
            command.error(str(exc))
    handlers = {
        "chat": _chat,
        "run": _chat,
        "list": _list,
        "ps": _ps,
        "show": _show,
        "bench": _bench,
        "doctor": _doctor,
        "embed": _embed,
        "rpc-server": _rpc_server,
        "stop": _stop,
        "pull": _pull,
        "rm": _rm,
        "setup": _setup,
    }
    try:
        return handlers[args.command](args)
    except RpcError as exc:
        return _rpc_failure(args, exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
