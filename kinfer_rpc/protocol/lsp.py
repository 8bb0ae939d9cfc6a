"""LSP's editor features: kinfer-rpc as a language server that completes code with the local model.

An editor's stock LSP client (Neovim's, a VS Code generic client, Helix, eglot) opens documents
with `textDocument/didOpen`, keeps them current with `textDocument/didChange` (incremental edits,
positions in UTF-16 code units as LSP requires) and asks for `textDocument/completion` or
`textDocument/inlineCompletion` (LSP 3.18). Each completion is one `inference/infill` over the
document: the text before the cursor's line is the prefix, that line before the cursor the middle
(after the model's middle token, as llama.vim sends it: typing on a line changes only the
prompt's end, so the prefix pool keeps the rest), the text after the cursor the suffix (the infill
method budgets each).

Typing stays fast: a completion request for a document makes the one it sent before (same
method, same document) stale; a stale request still running is stopped and answered with an
empty result. The document's view is taken when the request arrives (`Editor.accept`, called in
message order, queues it behind the edits before it: protocol/documents.py), so an edit that
follows a request in the input never leaks into it, and a huge edit before it is applied on a
worker thread while the server answers other requests. Positions past a line's or the document's
end are clamped, and so are the ranges of the answers.

A notification's mistakes (params of the wrong type, a malformed edit) are logged in one line:
a notification has no answer to carry an error.

Each completion also carries the repository as llama.vim gathers it: the ring's chunks of the
documents the editor showed (protocol/ring.py), read into the prefix pool in idle time
(`background`). A request's context chooses its options (Automatic: one line, a tight time
budget; Invoked: lines on); `n` alternatives share the first one's prompt through the prefix
pool and decode together; infill's streamed pieces let the layer stop it early (nIndent, tMaxPredictMs) or give up
on a long prompt (tMaxPromptMs). Items carry a `kinfer.accepted` command: the client runs it on
acceptance, and the completion that follows is computed ahead and served when the next request's
view matches.

Settings come from `initializationOptions.completion` and `workspace/didChangeConfiguration`
(`settings.kinfer.completion` or `settings.completion`); docs/editors.md describes the shape.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs

from kinfer_rpc import errors
from kinfer_rpc.protocol.connection import RequestContext
from kinfer_rpc.protocol.documents import Documents, Pending, View, clip, position
from kinfer_rpc.protocol.fields import Fields
from kinfer_rpc.protocol.options import load_request, request_options
from kinfer_rpc.protocol.text import utf16_len

log = logging.getLogger(__name__)

COMPLETION = "textDocument/completion"
INLINE_COMPLETION = "textDocument/inlineCompletion"
METHODS = (COMPLETION, INLINE_COMPLETION)

# LSP's TextDocumentSyncKind.Incremental; CompletionItemKind.Text; InsertTextFormat.PlainText.
SYNC_INCREMENTAL = 2
KIND_TEXT = 1
PLAIN_TEXT = 1

# What completions ask infill for unless the settings say otherwise: a short, greedy continuation
# of the current line (clients without inline completion show one line best).
DEFAULT_OPTIONS: dict[str, Any] = {"maxTokens": 64, "stopAtLine": True, "temperature": 0}
COMPLETION_FIELDS = ("model", "backend", "loadOptions", "languages", "enabled", "openFiles", "ring", "speculate")
SPECULATE = ("never", "accepted", "always")  # when the completion after an answer is computed ahead
PROFILES = ("automatic", "invoked")  # options for requests by how they were triggered
# What the LSP layer does with a request, beside infill's options (settings at the top level,
# in a language's object or in a profile, like the options): alternatives, the indentation
# stop, the time budgets (milliseconds; 0: none).
KNOBS: dict[str, Any] = {"n": 1, "nIndent": True, "tMaxPromptMs": 0, "tMaxPredictMs": 0}
MAX_N = 8
# An Automatic request (inline completion's triggerKind 1, completion's 2 and 3): one line, in a
# tight time budget; an Invoked one (inline completion's triggerKind 0): lines on.
DEFAULT_PROFILES: dict[str, dict[str, Any]] = {
    "automatic": {"stopAtLine": True, "tMaxPromptMs": 500, "tMaxPredictMs": 250},
    "invoked": {"stopAtLine": False},
}

KEY_CHARS = 4096  # how much of each side of the cursor a speculation's key compares
ALT_TEMPERATURE = 0.8  # an alternative's temperature when the settings' is 0 (greedy)
# workspace/executeCommand's commands: an item accepted (its `command`); the per-document counts.
ACCEPTED = "kinfer.accepted"
STATS = "kinfer.stats"
# Where a completion request's view travels from accept() to its handler, inside its params.
PINNED = "kinfer/pinned"

Infill = Callable[..., Awaitable[dict[str, Any]]]  # Handlers.inference_infill(ctx, /, **params)
Load = Callable[..., Awaitable[dict[str, Any]]]  # Handlers.model_load(ctx, /, **params)
Notify = Callable[[str, Any], None]


def capabilities() -> dict[str, Any]:
    """The LSP members of initialize's ServerCapabilities."""
    return {
        "positionEncoding": "utf-16",
        "textDocumentSync": {"openClose": True, "change": SYNC_INCREMENTAL, "save": {"includeText": False}},
        "completionProvider": {"resolveProvider": False},
        "inlineCompletionProvider": {},
        "executeCommandProvider": {"commands": [ACCEPTED, STATS]},
    }


# -- settings -----------------------------------------------------------------------------------
@attrs.frozen
class RingSettings:
    """The ring of chunks (protocol/ring.py): its bounds, and how long the editor is idle before
    the chunks are read into the prefix pool (0: never)."""

    chunks: int = 16
    chunk_lines: int = 64
    chars: int = 16384
    warm_ms: int = 1000


@attrs.frozen
class Settings:
    """What completions use: which model, loaded how, and the options of each request."""

    model: str | None = None
    backend: str | None = None
    load_options: dict[str, Any] | None = None
    options: dict[str, Any] = attrs.field(factory=lambda: dict(DEFAULT_OPTIONS))
    languages: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    enabled: bool = True
    open_files: bool = False
    ring: RingSettings = attrs.field(factory=RingSettings)
    speculate: str = "accepted"
    profiles: dict[str, dict[str, Any]] = attrs.field(factory=lambda: {k: dict(v) for k, v in DEFAULT_PROFILES.items()})

    def options_for(self, language: str, profile: str | None = None) -> tuple[bool, dict[str, Any]]:
        """Whether completions are on for `language`, and the inference options they use (with
        KNOBS among them) for a request of `profile` (None: the settings' own)."""
        own = dict(self.languages.get(language, {}))
        enabled = own.pop("enabled", self.enabled)
        chosen = self.profiles.get(profile, {}) if profile is not None else {}
        return bool(enabled), {**KNOBS, **self.options, **chosen, **own}


def split_knobs(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """infill's options, and the KNOBS (each with its default when not given)."""
    knobs = {k: options.get(k, v) for k, v in KNOBS.items()}
    return {k: v for k, v in options.items() if k not in KNOBS}, knobs


def _check_knobs(options: dict[str, Any], where: str) -> None:
    for name, value in options.items():
        if name not in KNOBS:
            continue
        field = f"{where}.{name}"
        if name == "nIndent":
            if not isinstance(value, bool):
                raise errors.invalid_params(f"{field} must be true or false", {"field": field})
            continue
        hi = MAX_N if name == "n" else 60_000
        lo = 1 if name == "n" else 0
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise errors.invalid_params(f"{field} must be an integer from {lo} to {hi}", {"field": field})


def _check_options(options: dict[str, Any], where: str) -> None:
    """The inference options a completion will send, checked now (as inference/infill will)."""
    _check_knobs(options, where)
    try:
        request_options(split_knobs(options)[0], infill=True)
    except errors.KinferError as exc:
        raise errors.KinferError(exc.code, exc.message.replace("options", where, 1), exc.data) from None


def parse_settings(value: object, where: str) -> Settings:
    """The `completion` settings object; every mistake is a -32602 that names the field."""
    if value is None:
        return Settings()
    if not isinstance(value, dict):
        raise errors.invalid_params(f"{where} must be an object", {"field": where})
    f = Fields(value, where)
    model = f.str("model")
    backend = f.str("backend")
    loads = f.raw("loadOptions")
    if loads is not None and not isinstance(loads, dict):
        raise errors.invalid_params(f"{where}.loadOptions must be an object", {"field": f"{where}.loadOptions"})
    if loads is not None:
        try:
            load_request(loads)
        except errors.KinferError as exc:
            raise errors.KinferError(
                exc.code, exc.message.replace("options", f"{where}.loadOptions", 1), exc.data
            ) from None
    enabled = f.bool("enabled", True)
    open_files = f.bool("openFiles", False)
    ring = _ring(f.raw("ring"), f"{where}.ring")
    speculate = f.str("speculate", "accepted")
    if speculate not in SPECULATE:
        raise errors.invalid_params(
            f"{where}.speculate must be one of {', '.join(SPECULATE)}", {"field": f"{where}.speculate"}
        )
    profiles_raw = {name: f.raw(name) for name in PROFILES}
    languages_raw = f.raw("languages") or {}
    if not isinstance(languages_raw, dict):
        raise errors.invalid_params(f"{where}.languages must be an object", {"field": f"{where}.languages"})
    options = {k: v for k, v in value.items() if k not in (*COMPLETION_FIELDS, *PROFILES) and v is not None}
    merged = {**DEFAULT_OPTIONS, **options}
    _check_options(merged, where)
    profiles: dict[str, dict[str, Any]] = {}
    for name, own in profiles_raw.items():
        pwhere = f"{where}.{name}"
        if own is not None and not isinstance(own, dict):
            raise errors.invalid_params(f"{pwhere} must be an object", {"field": pwhere})
        profiles[name] = {**DEFAULT_PROFILES[name], **{k: v for k, v in (own or {}).items() if v is not None}}
        _check_options({**merged, **profiles[name]}, pwhere)
    languages: dict[str, dict[str, Any]] = {}
    for lang, own in languages_raw.items():
        lwhere = f"{where}.languages.{lang}"
        if not isinstance(own, dict):
            raise errors.invalid_params(f"{lwhere} must be an object", {"field": lwhere})
        own = {k: v for k, v in own.items() if v is not None}
        lang_enabled = own.get("enabled")
        if lang_enabled is not None and not isinstance(lang_enabled, bool):
            raise errors.invalid_params(f"{lwhere}.enabled must be true or false", {"field": f"{lwhere}.enabled"})
        _check_options({**merged, **{k: v for k, v in own.items() if k != "enabled"}}, lwhere)
        languages[lang] = own
    return Settings(
        model, backend, loads, merged, languages, bool(enabled), bool(open_files), ring, speculate, profiles
    )


def _ring(value: object, where: str) -> RingSettings:
    """The `ring` setting: false turns it off, an object sizes it."""
    if value is None or value is True:
        return RingSettings()
    if value is False:
        return RingSettings(chunks=0, warm_ms=0)
    f = Fields(value, where)
    out = RingSettings(
        chunks=f.int("chunks", 16, lo=0, hi=1024),
        chunk_lines=f.int("chunkLines", 64, lo=1, hi=4096),
        chars=f.int("chars", 16384, lo=0, hi=1 << 20),
        warm_ms=f.int("warmMs", 1000, lo=0, hi=3_600_000),
    )
    f.done()
    return out


def settings_in(value: object) -> object:
    """The completion settings inside a didChangeConfiguration's `settings` (or initialization
    options): `kinfer.completion`, else `completion`; None when neither is there."""
    if not isinstance(value, dict):
        return None
    inner = value.get("kinfer")
    if isinstance(inner, dict) and "completion" in inner:
        return inner["completion"]
    return value.get("completion")


# -- the editor ---------------------------------------------------------------------------------
@attrs.frozen
class Pinned:
    """A completion request as it arrived: its document's view is taken then (in order with the
    edits), ready when the edits before it have been applied."""

    uri: str
    method: str
    generation: int
    language: str
    view: Pending[View]
    profile: str | None = None  # "automatic" or "invoked" (by its context's triggerKind), None: neither said


@attrs.frozen
class Answer:
    """A completion's alternatives (the first the best), the model that wrote them, and the
    prompt tokens each read and found cached."""

    texts: tuple[str, ...]
    model: str
    usage: tuple[dict[str, Any], ...] = ()


@attrs.define
class Speculation:
    """The completion computed ahead for the document as it will be once an answer is accepted:
    the text before the cursor then (its end, and its length) and after it (its start, length)."""

    key: tuple[str, int, str, int]
    done: anyio.Event = attrs.field(factory=anyio.Event)
    answer: Answer | None = None


@attrs.define
class DocStats:
    """Per document: completions answered with text, alternatives offered, answers accepted and
    their characters, and answers served from a speculation."""

    answered: int = 0
    offered: int = 0
    accepted: int = 0
    accepted_chars: int = 0
    speculated: int = 0

    def json(self) -> dict[str, int]:
        return {
            "answered": self.answered,
            "offered": self.offered,
            "accepted": self.accepted,
            "acceptedChars": self.accepted_chars,
            "speculated": self.speculated,
        }


def _key(prefix: str, middle: str, suffix: str) -> tuple[str, int, str, int]:
    """What a speculation is matched on: the ends of the text before the cursor (`prefix` and
    `middle`) and after it, and their lengths (no copy of a long document)."""
    return (prefix[-KEY_CHARS:] + middle)[-KEY_CHARS:], len(prefix) + len(middle), suffix[:KEY_CHARS], len(suffix)


@attrs.frozen
class Answered:
    """A document's last answer: its view's texts, and the ids of the items it offered."""

    language: str
    prefix: str
    middle: str
    suffix: str
    view: View
    ids: dict[str, str]  # item id -> its text
    profile: str | None = None  # the request's, which the completion computed ahead takes too


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def cut(text: str, indent: int | None, predict_s: float | None) -> tuple[str, bool]:
    """`text` cut where a completion stops early, and whether it does: at the start of the first
    line after the first whose indentation is less than `indent` (as llama.cpp's `n_indent`; its
    line break goes too), and, once `predict_s` (the time budget for generating) is spent, after
    the last whole line."""
    if indent:
        at = text.find("\n")
        while at >= 0:
            nxt = text.find("\n", at + 1)
            line = text[at + 1 : nxt if nxt >= 0 else len(text)]
            if line.strip() and _indent(line) < indent:
                return text[:at].removesuffix("\r"), True
            if nxt < 0:
                break
            at = nxt
    if predict_s is not None and "\n" in text:
        return text[: text.rindex("\n") + 1], True
    return text, False


class _Watch:
    """What inference/infill takes as its request's context: its reply's pieces stream here, so
    that the LSP layer can stop it where a completion ends early (nIndent, tMaxPredictMs)."""

    id = None
    method = "inference/infill"
    partial_result_token = "kinfer/lsp"
    work_done_token = None

    def __init__(self, on_piece: Callable[[str], None]) -> None:
        self.connection = self
        self.owner = 0
        self.partial: Any = None
        self.received = time.perf_counter()
        self._on_piece = on_piece

    async def report_partial(self, value: Any) -> None:
        if isinstance(value, dict) and isinstance(value.get("text"), str):
            self._on_piece(value["text"])

    async def work_done(self, kind: str, **fields: Any) -> None:
        return None

    def work_done_nowait(self, kind: str, **fields: Any) -> None:
        return None


class Editor:
    """Open documents, completion settings, and the completion requests running per document."""

    def __init__(
        self,
        infill: Infill,
        load: Load,
        loaded: Callable[[str], bool],
        notify: Notify,
    ) -> None:
        self._infill = infill
        self._load = load
        self._loaded = loaded
        self._notify = notify
        self.documents = Documents()
        self.settings = Settings()
        self._generation: dict[tuple[str, str], int] = {}  # (uri, method) -> requests accepted
        self._live: dict[tuple[str, str], tuple[int, anyio.CancelScope]] = {}
        self._model: tuple[str, str] | None = None  # (the settings' load, as JSON; the model it loaded)
        self._last_model = ""
        # Background work (Editor.background): warming the ring's chunks, speculating.
        self._wake = anyio.Event()
        self._active = time.monotonic()  # when the last request or edit came
        self._bg_scope: anyio.CancelScope | None = None
        self._bg_kind = ""  # what runs in it: "warm" or "speculation"
        self._warm_target: tuple[str, str] | None = None  # (uri, language) of the last document worked on
        self._warmed: list[tuple[str, str]] | None = None  # the chunks read into the pool last
        self.warms = 0  # warming requests that ran to their end (for tests and stats)
        # What to compute ahead next: (uri, the answer, the accepted text, its Speculation)
        self._speculate: tuple[str, Answered, str, Speculation] | None = None
        self._running = False  # background() runs (else nothing is computed ahead)
        self._answered: dict[str, Answered] = {}  # uri -> its last answer
        self._spec: dict[str, Speculation] = {}  # uri -> the completion computed ahead for it
        self._offered: dict[str, tuple[str, str]] = {}  # item id -> (uri, text)
        self._ids = 0
        self.stats: dict[str, DocStats] = {}

    # -- settings ----------------------------------------------------------------------------
    def _apply(self, settings: Settings) -> None:
        self.settings = settings
        r = settings.ring
        self.documents.ring.configure(r.chunks, r.chunk_lines, r.chars)

    def initialize(self, init: dict[str, Any]) -> None:
        """initializationOptions' `completion` member, checked (raises -32602) and applied."""
        value = settings_in(init)
        if value is not None:
            self._apply(parse_settings(value, "initializationOptions.completion"))

    async def did_change_configuration(self, /, *args: Any, **p: Any) -> None:
        if args:
            log.warning("workspace/didChangeConfiguration ignored: params must be an object")
            return
        value = settings_in(p.get("settings"))
        if value is None:
            return  # not ours (or a client's "pull" hint, with null settings): keep what we have
        try:
            self._apply(parse_settings(value, "settings.kinfer.completion"))
        except errors.KinferError as exc:
            # A notification has no answer: say why in the client's log, keep the settings we had.
            self._notify(
                "window/logMessage", {"type": 1, "message": f"kinfer-rpc: settings not applied: {clip(exc.message)}"}
            )

    # -- documents ---------------------------------------------------------------------------
    def _notified(self, method: str, args: tuple[Any, ...], apply: Callable[[], None]) -> None:
        """A notification applied; a mistake in its params logged in one line (a notification
        has no answer to carry an error)."""
        try:
            if args:
                raise errors.invalid_params("params must be an object")
            apply()
        except errors.KinferError as exc:
            log.warning("%s ignored: %s", method, clip(exc.message))

    def _touched(self, uri: str) -> None:
        """An edit or request: the editor is busy now; warm for this document when idle."""
        self._active = time.monotonic()
        doc = self.documents.get(uri)
        if doc is not None:
            self._warm_target = (uri, doc.language)
        self._wake.set()

    async def did_open(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            f = Fields(p.get("textDocument"), "params.textDocument")
            uri, language = f.str("uri"), f.str("languageId", "")
            version, text = f.int("version", 0), f.str("text", "")
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_open(uri, language, version, text)
            self._touched(uri)

        self._notified("textDocument/didOpen", args, apply)

    async def did_change(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            f = Fields(p.get("textDocument"), "params.textDocument")
            uri, version = f.str("uri"), f.int("version", None)
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_change(uri, version, p.get("contentChanges"))
            self._touched(uri)

        self._notified("textDocument/didChange", args, apply)

    async def did_save(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            uri = Fields(p.get("textDocument"), "params.textDocument").str("uri")
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_save(uri)
            self._touched(uri)

        self._notified("textDocument/didSave", args, apply)

    async def did_close(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            uri = Fields(p.get("textDocument"), "params.textDocument").str("uri")
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_close(uri)
            for key in [k for k in self._live if k[0] == uri]:
                self._live.pop(key)[1].cancel()
            self._spec.pop(uri, None)
            self._answered.pop(uri, None)

        self._notified("textDocument/didClose", args, apply)

    # -- completions -------------------------------------------------------------------------
    def accept(self, method: str, params: dict[str, Any] | list[Any]) -> None:
        """A completion request arriving (in message order): its document's view taken as of now,
        and the request it makes stale stopped. Raises -32602 for params a completion cannot use."""
        if not isinstance(params, dict):
            raise errors.invalid_params("params must be an object")
        params.pop(PINNED, None)
        f = Fields(params.get("textDocument"), "params.textDocument")
        uri = f.str("uri")
        if uri is None:
            raise errors.invalid_params("params.textDocument.uri is required", {"field": "params.textDocument.uri"})
        line, character = position(params.get("position"), "params.position")
        profile, insert = _context(method, params.get("context"))
        doc = self.documents.get(uri)
        if doc is None:
            raise errors.invalid_params(
                f"{clip(uri)} is not open (textDocument/didOpen first)", {"field": "params.textDocument"}
            )
        key = (uri, method)
        generation = self._generation.get(key, 0) + 1
        self._generation[key] = generation
        live = self._live.pop(key, None)
        if live is not None:
            live[1].cancel()  # stale: it answers an empty result
        if self._bg_kind == "warm" and self._bg_scope is not None:
            self._bg_scope.cancel()  # a warm never delays a completion (a speculation may serve it)
        self._touched(uri)
        extra = self.documents.relevant(doc) if self.settings.open_files else []
        ring = self.settings.ring.chunks > 0
        view = self.documents.view(doc, line, character, extra, ring=ring, insert=insert)
        params[PINNED] = Pinned(uri, method, generation, doc.language, view, profile)

    async def _complete(self, pin: Pinned) -> tuple[Answer, View | None]:
        """The continuations for a pinned request, the model that wrote them and the request's
        view; no text when the request went stale or completions are off. A line completion
        (stopAtLine) never ends with the line break the model stopped at: accepting it must not
        split the line."""
        none = Answer((), "")
        key = (pin.uri, pin.method)
        if self._generation.get(key) != pin.generation:
            return none, None  # a newer request came before this one started
        enabled, options = self.settings.options_for(pin.language, pin.profile)
        if not enabled:
            return none, None
        options, knobs = split_knobs(options)
        scope = anyio.CancelScope()
        self._live[key] = (pin.generation, scope)
        answer: Answer | None = None
        view: View | None = None
        try:
            with scope:
                view = await pin.view.wait()
                prefix, middle, suffix = view.texts()
                answer = await self._speculated(pin.uri, prefix, middle, suffix)
                if answer is None:
                    answer = await self._alternatives((prefix, middle, suffix), view.extra, options, knobs)
        finally:
            live = self._live.get(key)
            if live is not None and live[0] == pin.generation:
                del self._live[key]
        if answer is None:  # the scope was cancelled: a newer request made it stale
            return none, None
        if options.get("stopAtLine"):
            answer = attrs.evolve(answer, texts=tuple(t.removesuffix("\n").removesuffix("\r") for t in answer.texts))
        if view is not None:
            done = Answered(pin.language, prefix, middle, suffix, view, {}, pin.profile)
            self._answered[pin.uri] = done
            if self.settings.speculate == "always" and answer.texts and answer.texts[0].strip():
                self._queue(pin.uri, done, answer.texts[0])
        return answer, view

    def _queue(self, uri: str, answered: Answered, text: str) -> None:
        """Compute ahead the completion of `uri` once `text` is accepted after `answered`: its
        Speculation is there at once (a request that matches it waits for it); what was queued
        before and not started is dropped."""
        if not self._running:
            return
        spec = self._spec.get(uri)
        key = _key(answered.prefix, answered.middle + text, answered.suffix)
        if spec is not None and spec.key == key:
            return  # computed ahead already (or being computed)
        self._drop_queued()
        spec = self._spec[uri] = Speculation(key)
        self._speculate = (uri, answered, text, spec)
        self._wake.set()

    def _drop_queued(self, uri: str | None = None) -> None:
        """Forget the speculation queued and not started (only `uri`'s, when given)."""
        if self._speculate is not None and uri in (None, self._speculate[0]):
            queued_uri, _, _, spec = self._speculate
            self._speculate = None
            spec.done.set()
            if self._spec.get(queued_uri) is spec:
                del self._spec[queued_uri]

    async def _alternatives(
        self,
        texts: tuple[str, str, str],
        extra: tuple[tuple[str, str], ...],
        options: dict[str, Any],
        knobs: dict[str, Any],
    ) -> Answer:
        """`n` completions of a view's prefix, middle and suffix (and extra files): the first with
        the settings' options, then the others at once with other seeds (and, when the settings
        are greedy, a temperature): the prefix pool holds the prompt the first read, so the others
        read only its last token, and they decode in the same passes."""
        prefix, middle, suffix = texts
        model = await self._model_name()
        params: dict[str, Any] = {"prefix": prefix, "middle": middle, "suffix": suffix}
        if model is not None:
            params["model"] = model
        if extra:
            params["extra"] = [{"filename": name, "text": text} for name, text in extra]
        indent = _indent(middle) if knobs["nIndent"] else None
        if model is None and not (self._last_model and self._loaded(self._last_model)):
            knobs = {**knobs, "tMaxPromptMs": 0}  # infill may load a model first: no prompt budget then
        got: list[tuple[str, str, dict[str, Any]] | None] = [None] * knobs["n"]

        async def one(i: int) -> None:
            opts = dict(options)
            if i:
                opts["seed"] = int(options.get("seed") or 0) + i
                if not options.get("temperature"):
                    opts["temperature"] = ALT_TEMPERATURE
            got[i] = await self._infill_once({**params, "options": opts}, knobs, indent)

        await one(0)
        if len(got) > 1:
            async with anyio.create_task_group() as tg:
                for i in range(1, len(got)):
                    tg.start_soon(one, i)
        found: list[str] = []
        for text, _, _ in filter(None, got):
            if text not in found:
                found.append(text)
        done = [g for g in got if g is not None]
        return Answer(tuple(found), done[0][1], tuple(used for _, _, used in done))

    async def _infill_once(
        self, params: dict[str, Any], knobs: dict[str, Any], indent: int | None
    ) -> tuple[str, str, dict[str, Any]]:
        """One inference/infill, stopped early where `cut` says, or with no text when the prompt
        is not read within tMaxPromptMs (what was read stays in the prefix pool for the next)."""
        pieces: list[str] = []
        first: float | None = None
        stopped: str | None = None
        predict_ms, prompt_ms = knobs["tMaxPredictMs"], knobs["tMaxPromptMs"]
        scope = anyio.CancelScope()
        if prompt_ms:
            scope.deadline = anyio.current_time() + prompt_ms / 1000

        def on_piece(text: str) -> None:
            nonlocal first, stopped
            now = time.monotonic()
            if first is None:
                first = now
                scope.deadline = math.inf
            pieces.append(text)
            late = predict_ms and (now - first) * 1000 >= predict_ms
            out, early = cut("".join(pieces), indent, now - first if late else None)
            if early:
                stopped = out
                scope.cancel()

        result: dict[str, Any] | None = None
        watch = _Watch(on_piece)
        with scope:
            result = await self._infill(watch, **params)
        if result is not None:
            self._last_model = result.get("model", "") or self._last_model
            text, _ = cut(result["text"], indent, None)
            return text, result.get("model", ""), dict(result.get("usage") or {})
        partial = watch.partial() if callable(watch.partial) else {}  # the reply so far, as infill had it
        return stopped or "", self._last_model, dict(partial.get("usage") or {})

    async def _speculated(self, uri: str, prefix: str, middle: str, suffix: str) -> Answer | None:
        """The completion computed ahead for this view, when there is one (waiting for it if it
        is still running); otherwise None, and any background work is stopped."""
        spec = self._spec.get(uri)
        if spec is not None and spec.key == _key(prefix, middle, suffix):
            await spec.done.wait()
            if spec.answer is not None:
                self.stats.setdefault(uri, DocStats()).speculated += 1
                return spec.answer
        self._drop_queued(uri)
        if self._bg_scope is not None:
            self._bg_scope.cancel()
        return None

    async def _model_name(self) -> str | None:
        """The model the settings name, loaded with their load options (once); None to let
        inference/infill choose (the model used last, else the default)."""
        s = self.settings
        if s.model is None and s.backend is None and s.load_options is None:
            return None
        wanted = json.dumps([s.model, s.backend, s.load_options], sort_keys=True)
        if self._model is not None and self._model[0] == wanted and self._loaded(self._model[1]):
            return self._model[1]
        described = await self._load(None, model=s.model, backend=s.backend, options=s.load_options)
        name: str = described["model"]
        self._model = (wanted, name)
        return name

    def running(self, uri: str) -> int:
        """Completion requests for `uri` still running (for tests: at most one per method)."""
        return sum(1 for k in self._live if k[0] == uri)

    def _offer(self, uri: str, text: str) -> dict[str, Any]:
        """The command an item carries: the client runs it when the item is accepted."""
        self._ids += 1
        ident = str(self._ids)
        self._offered[ident] = (uri, text)
        while len(self._offered) > 256:
            self._offered.pop(next(iter(self._offered)))
        answered = self._answered.get(uri)
        if answered is not None:
            answered.ids[ident] = text
        return {"title": "kinfer: accepted", "command": ACCEPTED, "arguments": [{"uri": uri, "id": ident}]}

    def _count(self, uri: str, answer: Answer) -> None:
        if answer.texts:
            stats = self.stats.setdefault(uri, DocStats())
            stats.answered += 1
            stats.offered += len(answer.texts)

    async def completion(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        pin = p.pop(PINNED)
        assert isinstance(pin, Pinned), "accept() pinned the request"
        answer, view = await self._complete(pin)
        texts = [t for t in answer.texts if t.strip()]
        if view is None or not texts:
            return {"isIncomplete": True, "items": []}
        self._count(pin.uri, attrs.evolve(answer, texts=tuple(texts)))
        start = view.start or (view.line, view.character - utf16_len(view.word))
        word = view.word if view.start is None else ""
        items = []
        for i, text in enumerate(texts):
            new_text = word + text
            first = new_text.split("\n", 1)[0].rstrip("\r")
            label = first if first.strip() else next(line.strip() for line in new_text.splitlines() if line.strip())
            item: dict[str, Any] = {
                "label": label,
                "kind": KIND_TEXT,
                "detail": f"kinfer ({answer.model})",
                "preselect": i == 0,
                "sortText": str(i),
                "insertTextFormat": PLAIN_TEXT,
                "textEdit": {
                    # The view's cursor is clamped to the document: a range never reaches past it.
                    "range": {
                        "start": {"line": start[0], "character": start[1]},
                        "end": {"line": view.line, "character": view.character},
                    },
                    "newText": new_text,
                },
                "command": self._offer(pin.uri, text),
            }
            if not i and answer.usage:
                item["data"] = {"usage": list(answer.usage)}
            items.append(item)
        # isIncomplete: the next keystroke asks again rather than filtering this list.
        return {"isIncomplete": True, "items": items}

    async def inline_completion(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        pin = p.pop(PINNED)
        assert isinstance(pin, Pinned), "accept() pinned the request"
        answer, view = await self._complete(pin)
        texts = [t for t in answer.texts if t]
        if view is None or not texts:
            return {"items": []}
        self._count(pin.uri, attrs.evolve(answer, texts=tuple(texts)))
        here = {"line": view.line, "character": view.character}
        if view.start is None:
            rng, lead = {"start": here, "end": here}, ""
        else:  # the selected completion's text leads each item, over its range
            rng = {"start": {"line": view.start[0], "character": view.start[1]}, "end": here}
            lead = _selected(view)
        return {
            "items": [
                {"insertText": lead + text, "range": rng, "command": self._offer(pin.uri, text)} for text in texts
            ]
        }

    # -- commands ----------------------------------------------------------------------------
    async def execute_command(self, ctx: RequestContext | None, /, *args: Any, **p: Any) -> Any:
        """workspace/executeCommand: `kinfer.accepted` (an item was accepted: counted, and the
        completion after it computed ahead when it was not already) and `kinfer.stats` (the
        per-document counts)."""
        if args:
            raise errors.invalid_params("params must be an object")
        f = Fields(p, "params")
        command = f.str("command")
        arguments = f.raw("arguments") or []
        f.raw("workDoneToken")
        f.done()
        if not isinstance(arguments, list):
            raise errors.invalid_params("params.arguments must be an array", {"field": "params.arguments"})
        arg = arguments[0] if arguments and isinstance(arguments[0], dict) else {}
        if command == ACCEPTED:
            offered = self._offered.pop(str(arg.get("id")), None)
            if offered is None:
                return None  # an old item: nothing to count
            uri, text = offered
            stats = self.stats.setdefault(uri, DocStats())
            stats.accepted += 1
            stats.accepted_chars += len(text)
            answered = self._answered.get(uri)
            if self.settings.speculate != "never" and answered is not None and arg.get("id") in answered.ids:
                self._queue(uri, answered, text)
            return None
        if command == STATS:
            asked = arg.get("uri")
            if isinstance(asked, str):
                return {"documents": {asked: self.stats.get(asked, DocStats()).json()}, "warms": self.warms}
            return {"documents": {u: s.json() for u, s in self.stats.items()}, "warms": self.warms}
        raise errors.invalid_params(f"unknown command {clip(command)}", {"field": "params.command"})

    # -- background: warming the ring, speculating ------------------------------------------
    async def background(self) -> None:
        """Runs while the server does: computes the completion that follows an answer's
        acceptance as soon as the answer is out, and reads the ring's chunks into the prefix
        pool once the editor has been idle `ring.warmMs` (a completion arriving stops it)."""
        self._running = True
        try:
            await self._background()
        finally:
            self._running = False
            self._drop_queued()

    def stop(self) -> None:
        """The server is ending: the background work stops, and nothing more is queued."""
        self.settings = attrs.evolve(self.settings, ring=RingSettings(chunks=0, warm_ms=0), speculate="never")
        self._drop_queued()
        if self._bg_scope is not None:
            self._bg_scope.cancel()

    async def _background(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            if self._speculate is not None:
                job, self._speculate = self._speculate, None
                await self._guarded(self._run_speculation(*job), "speculation")
                continue
            warm_ms = self.settings.ring.warm_ms
            if not warm_ms or self._warm_target is None:
                continue
            while (idle := time.monotonic() - self._active) * 1000 < warm_ms:
                with anyio.move_on_after(warm_ms / 1000 - idle):
                    await self._wake.wait()
                if self._wake.is_set():
                    self._wake = anyio.Event()
                    if self._speculate is not None:
                        self._wake.set()
                        break
            else:
                if not self._live:
                    await self._guarded(self._warm(), "warm")

    async def _guarded(self, work: Awaitable[None], kind: str) -> None:
        scope = self._bg_scope = anyio.CancelScope()
        self._bg_kind = kind
        try:
            with scope:
                await work
        except errors.KinferError as exc:
            log.info("background completion work failed: %s", clip(exc.message))
        finally:
            if self._bg_scope is scope:
                self._bg_scope, self._bg_kind = None, ""

    async def _warm(self) -> None:
        assert self._warm_target is not None
        uri, language = self._warm_target
        doc = self.documents.get(uri)
        if doc is None:
            return
        enabled, options = self.settings.options_for(language)
        exclude = {d.filename for d in self.documents.relevant(doc)} if self.settings.open_files else set()
        chunks = self.documents.ring.extra(language, exclude, (doc.filename, doc.line))
        if not enabled or not chunks or chunks == self._warmed:
            return
        self._warmed = chunks
        options, _ = split_knobs(options)
        params: dict[str, Any] = {
            "prefix": "",
            "suffix": "",
            "extra": [{"filename": n, "text": t} for n, t in chunks],
            "options": {**options, "maxTokens": 1},
        }
        model = await self._model_name()
        if model is not None:
            params["model"] = model
        await self._infill(None, **params)
        self.warms += 1

    async def _run_speculation(self, uri: str, answered: Answered, text: str, spec: Speculation) -> None:
        """The completion of the document as it is once `text` is accepted at the cursor."""
        prefix, middle, suffix = answered.prefix, answered.middle + text, answered.suffix
        try:
            enabled, options = self.settings.options_for(answered.language, answered.profile)
            if not enabled:
                return
            options, knobs = split_knobs(options)
            knobs = {**knobs, "n": 1, "tMaxPromptMs": 0}
            cut_at = max(middle.rfind("\n"), middle.rfind("\r")) + 1
            if cut_at:  # the accepted text ended a line: the prompt's middle is the new last line
                prefix, middle = prefix + middle[:cut_at], middle[cut_at:]
            spec.answer = await self._alternatives((prefix, middle, suffix), answered.view.extra, options, knobs)
            if options.get("stopAtLine"):
                spec.answer = attrs.evolve(
                    spec.answer, texts=tuple(t.removesuffix("\n").removesuffix("\r") for t in spec.answer.texts)
                )
        finally:
            spec.done.set()
            if spec.answer is None and self._spec.get(uri) is spec:
                del self._spec[uri]


def _selected(view: View) -> str:
    return view.before[-1] if view.start is not None and view.before else ""


def _context(method: str, value: object) -> tuple[str | None, tuple[tuple[int, int], str] | None]:
    """A request's context: its profile by triggerKind ("automatic", "invoked" or None), and for
    an inline completion the selected completion item (its range's start, its text)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise errors.invalid_params("params.context must be an object", {"field": "params.context"})
    kind = value.get("triggerKind")
    if kind is not None and (isinstance(kind, bool) or not isinstance(kind, int)):
        raise errors.invalid_params("params.context.triggerKind must be an integer", {"field": "params.context"})
    if method == COMPLETION:  # 1 Invoked (typing, in VS Code, too), 2 TriggerCharacter, 3 ForIncomplete
        return ("automatic" if kind in (2, 3) else None), None
    profile = {0: "invoked", 1: "automatic"}.get(kind) if kind is not None else None
    selected = value.get("selectedCompletionInfo")
    if selected is None:
        return profile, None
    where = "params.context.selectedCompletionInfo"
    if not isinstance(selected, dict) or not isinstance(selected.get("text"), str):
        raise errors.invalid_params(f"{where} must be an object with range and text", {"field": where})
    rng = selected.get("range")
    if not isinstance(rng, dict):
        raise errors.invalid_params(f"{where}.range must be a Range", {"field": f"{where}.range"})
    return profile, (position(rng.get("start"), f"{where}.range.start"), selected["text"])
