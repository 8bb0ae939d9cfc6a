"""`kinfer chat` and `kinfer run`: one question, or a conversation at a terminal."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kinfer_rpc.cli.common import _load, _server
from kinfer_rpc.cli.models import _model_facts
from kinfer_rpc.cli.output import _emit, _fill, _human, _message_width, err, out
from kinfer_rpc.client import (
    SERVER_GONE,
    Client,
    LoadedModel,
    Result,
    RpcError,
    Thought,
    ToolCall,
)
from kinfer_rpc.terminal import advice, columns, conversations, thinking
from kinfer_rpc.terminal import options as request_options
from kinfer_rpc.terminal.wrap import WordWrap


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
