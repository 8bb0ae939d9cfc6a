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

Settings come from `initializationOptions.completion` and `workspace/didChangeConfiguration`
(`settings.kinfer.completion` or `settings.completion`); docs/editors.md describes the shape.
"""

from __future__ import annotations

import json
import logging
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
COMPLETION_FIELDS = ("model", "backend", "loadOptions", "languages", "enabled", "openFiles")

# Where a completion request's view travels from accept() to its handler, inside its params.
PINNED = "kinfer/pinned"

Infill = Callable[..., Awaitable[dict[str, Any]]]  # Handlers.inference_infill(ctx, /, **params)
Load = Callable[..., Awaitable[dict[str, Any]]]  # Handlers.model_load(ctx, /, **params)
Notify = Callable[[str, Any], None]


def capabilities() -> dict[str, Any]:
    """The LSP members of initialize's ServerCapabilities."""
    return {
        "positionEncoding": "utf-16",
        "textDocumentSync": {"openClose": True, "change": SYNC_INCREMENTAL},
        "completionProvider": {"resolveProvider": False},
        "inlineCompletionProvider": {},
    }


# -- settings -----------------------------------------------------------------------------------
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

    def options_for(self, language: str) -> tuple[bool, dict[str, Any]]:
        """Whether completions are on for `language`, and the inference options they use."""
        own = dict(self.languages.get(language, {}))
        enabled = own.pop("enabled", self.enabled)
        return bool(enabled), {**self.options, **own}


def _check_options(options: dict[str, Any], where: str) -> None:
    """The inference options a completion will send, checked now (as inference/infill will)."""
    try:
        request_options(options, infill=True)
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
    languages_raw = f.raw("languages") or {}
    if not isinstance(languages_raw, dict):
        raise errors.invalid_params(f"{where}.languages must be an object", {"field": f"{where}.languages"})
    options = {k: v for k, v in value.items() if k not in COMPLETION_FIELDS and v is not None}
    merged = {**DEFAULT_OPTIONS, **options}
    _check_options(merged, where)
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
    return Settings(model, backend, loads, merged, languages, bool(enabled), bool(open_files))


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

    # -- settings ----------------------------------------------------------------------------
    def initialize(self, init: dict[str, Any]) -> None:
        """initializationOptions' `completion` member, checked (raises -32602) and applied."""
        value = settings_in(init)
        if value is not None:
            self.settings = parse_settings(value, "initializationOptions.completion")

    async def did_change_configuration(self, /, *args: Any, **p: Any) -> None:
        if args:
            log.warning("workspace/didChangeConfiguration ignored: params must be an object")
            return
        value = settings_in(p.get("settings"))
        if value is None:
            return  # not ours (or a client's "pull" hint, with null settings): keep what we have
        try:
            self.settings = parse_settings(value, "settings.kinfer.completion")
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

    async def did_open(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            f = Fields(p.get("textDocument"), "params.textDocument")
            uri, language = f.str("uri"), f.str("languageId", "")
            version, text = f.int("version", 0), f.str("text", "")
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_open(uri, language, version, text)

        self._notified("textDocument/didOpen", args, apply)

    async def did_change(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            f = Fields(p.get("textDocument"), "params.textDocument")
            uri, version = f.str("uri"), f.int("version", None)
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_change(uri, version, p.get("contentChanges"))

        self._notified("textDocument/didChange", args, apply)

    async def did_close(self, /, *args: Any, **p: Any) -> None:
        def apply() -> None:
            uri = Fields(p.get("textDocument"), "params.textDocument").str("uri")
            if uri is None:
                raise errors.invalid_params("params.textDocument.uri is required")
            self.documents.did_close(uri)
            for key in [k for k in self._live if k[0] == uri]:
                self._live.pop(key)[1].cancel()

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
        extra = self.documents.relevant(doc) if self.settings.open_files else []
        view = self.documents.view(doc, line, character, extra)
        params[PINNED] = Pinned(uri, method, generation, doc.language, view)

    async def _complete(self, pin: Pinned) -> tuple[str, str, View | None]:
        """The continuation for a pinned request, the model that wrote it and the request's view;
        an empty text when the request went stale or completions are off. A line completion
        (stopAtLine) never ends with the line break the model stopped at: accepting it must not
        split the line."""
        key = (pin.uri, pin.method)
        if self._generation.get(key) != pin.generation:
            return "", "", None  # a newer request came before this one started
        enabled, options = self.settings.options_for(pin.language)
        if not enabled:
            return "", "", None
        scope = anyio.CancelScope()
        self._live[key] = (pin.generation, scope)
        result: dict[str, Any] | None = None
        view: View | None = None
        try:
            with scope:
                view = await pin.view.wait()
                prefix, middle, suffix = view.texts()
                model = await self._model_name()
                params: dict[str, Any] = {"prefix": prefix, "middle": middle, "suffix": suffix, "options": options}
                if model is not None:
                    params["model"] = model
                if view.extra:
                    params["extra"] = [{"filename": name, "text": text} for name, text in view.extra]
                result = await self._infill(None, **params)
        finally:
            live = self._live.get(key)
            if live is not None and live[0] == pin.generation:
                del self._live[key]
        if result is None:  # the scope was cancelled: a newer request made it stale
            return "", "", None
        text: str = result["text"]
        if options.get("stopAtLine"):
            text = text.removesuffix("\n").removesuffix("\r")
        return text, result.get("model", ""), view

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

    async def completion(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        pin = p.pop(PINNED)
        assert isinstance(pin, Pinned), "accept() pinned the request"
        text, model, view = await self._complete(pin)
        if view is None or not text.strip():
            return {"isIncomplete": True, "items": []}
        new_text = view.word + text
        first = new_text.split("\n", 1)[0].rstrip("\r")
        label = first if first.strip() else next(line.strip() for line in new_text.splitlines() if line.strip())
        item: dict[str, Any] = {
            "label": label,
            "kind": KIND_TEXT,
            "detail": f"kinfer ({model})",
            "preselect": True,
            "sortText": "0",
            "insertTextFormat": PLAIN_TEXT,
            "textEdit": {
                # The view's cursor is clamped to the document: a range never reaches past it.
                "range": {
                    "start": {"line": view.line, "character": view.character - utf16_len(view.word)},
                    "end": {"line": view.line, "character": view.character},
                },
                "newText": new_text,
            },
        }
        # isIncomplete: the next keystroke asks again rather than filtering this list.
        return {"isIncomplete": True, "items": [item]}

    async def inline_completion(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        pin = p.pop(PINNED)
        assert isinstance(pin, Pinned), "accept() pinned the request"
        text, _, view = await self._complete(pin)
        if view is None or not text:
            return {"items": []}
        here = {"line": view.line, "character": view.character}
        return {"items": [{"insertText": text, "range": {"start": here, "end": here}}]}
