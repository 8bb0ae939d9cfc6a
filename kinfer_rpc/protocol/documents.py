"""The editor's open documents: their text (protocol/text.py), their edits applied in the order
they came, and the view of them a completion request takes.

Opening a document, editing it and taking a view of it are jobs, run one at a time in the order
they arrived (`Jobs`). A small job runs at once, on the event loop, when nothing is queued; a
large one (many edits, a long text), and every job that comes while one is queued or running,
runs on a worker thread. So a hostile `didChange` never holds the loop (other requests, such as
`model/status`, are answered while it applies), and a completion request that arrives after it
waits for it: the view it gets is the documents as they were when it arrived, never with an edit
that came after it.

Edits are checked before any is applied: a batch with a malformed change is dropped whole, and
logged in one line. A range past the document's end is clamped to it (and logged); a character
past its line's end is that end, as LSP says.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlparse

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs

from kinfer_rpc import errors
from kinfer_rpc.protocol.ring import Ring
from kinfer_rpc.protocol.text import Text

log = logging.getLogger(__name__)

T = TypeVar("T")

UINTEGER = 2**31 - 1  # LSP's uinteger: the largest line or character a position may have
LARGE_EDITS = 64  # a didChange with more edits than this is applied on the worker thread
LARGE_TEXT = 1 << 18  # so is one (or a didOpen) that carries more characters than this
WORD = 256  # the most identifier characters before the cursor a completion replaces
CLIP = 200  # the most characters of a uri or a message a log line carries
# What `openFiles` sends to infill at most: inference/infill's limit on files, and more text than
# any model's context holds (infill keeps the extra context's end: the most relevant file last).
OPEN_FILES = 1024
OPEN_FILES_CHARS = 1 << 20

Position = tuple[int, int]
Edit = tuple[tuple[Position, Position] | None, str]  # (range, or None for the whole text; new text)


def clip(value: object, limit: int = CLIP) -> str:
    """`value` as text for a log line, at most `limit` characters and a count of the rest."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


# -- jobs -----------------------------------------------------------------------------------------
class Pending(Generic[T]):
    """A job's result: ready at once when the job ran on the event loop, else when the worker
    thread has run it. Made on the event loop."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._token = anyio.lowlevel.current_token()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._ready = False

    def _set(self, value: T | None, error: BaseException | None, on_loop: bool) -> None:
        self._value, self._error, self._ready = value, error, True
        if on_loop:
            self._event.set()
            return
        try:
            anyio.from_thread.run_sync(self._event.set, token=self._token)
        except Exception:  # the loop has ended (the server is exiting): nobody waits any more
            pass

    @property
    def ready(self) -> bool:
        return self._ready

    async def wait(self) -> T:
        """The result (or the job's exception, raised)."""
        if not self._ready:
            await self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set with the job's value


class Jobs:
    """Work on the documents, one job at a time in the order it was given: a small job at once
    when nothing is queued, everything else on a worker thread (started when there is work,
    ending when there is none)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Callable[[], None]] = deque()
        self._busy = False  # a worker thread is running (it empties the queue, then ends)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._busy

    def run(self, job: Callable[[], None], *, large: bool) -> None:
        """Run `job` after every job given before it. Called on the event loop only."""
        start = False
        with self._lock:
            now = not self._busy and not large
            if not now:
                self._queue.append(job)
                start, self._busy = not self._busy, True
        if now:
            job()  # nothing queued or running: nothing can come between
        elif start:
            threading.Thread(target=self._drain, name="kinfer-documents", daemon=True).start()

    def result(self, job: Callable[[], T], *, large: bool = False) -> Pending[T]:
        """Run `job` in order, as `run` does; its value (or exception) when it has run."""
        pending: Pending[T] = Pending()
        on_loop = threading.get_ident()

        def wrapped() -> None:
            try:
                value = job()
            except Exception as exc:
                pending._set(None, exc, threading.get_ident() == on_loop)
            else:
                pending._set(value, None, threading.get_ident() == on_loop)

        self.run(wrapped, large=large)
        return pending

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._busy = False
                    return
                job = self._queue.popleft()
            try:
                job()
            except Exception:
                log.exception("a document job failed")


# -- documents --------------------------------------------------------------------------------------
@attrs.define(eq=False)
class Document:
    """An open document. `text` belongs to the jobs: read or change it only inside one."""

    uri: str
    language: str
    version: int
    text: Text
    # When it was opened, and when last edited or completed in (0: never): a count of the
    # documents' events, larger is later.
    opened: int
    touched: int
    folders: tuple[str, ...]  # its path's folders, to tell how near another document is
    line: int = 0  # where it was last edited or completed in (the ring's chunk on save)

    @property
    def filename(self) -> str:
        """The path of a file: uri, else the uri itself (what infill names it in the prompt)."""
        parsed = urlparse(self.uri)
        return unquote(parsed.path) if parsed.scheme == "file" else self.uri


@attrs.frozen
class View:
    """A completion request's view of its document (and of the others it takes as context), as
    they were when the request arrived."""

    before: tuple[str, ...]  # the text before the cursor, as chunks
    after: tuple[str, ...]
    line: int  # the cursor, clamped to the document
    character: int
    word: str  # the identifier characters just before the cursor on its line
    extra: tuple[tuple[str, str], ...] = ()  # (filename, text) of other documents, most relevant last
    start: Position | None = None  # where an inserted text (a selected completion) starts, clamped

    def texts(self) -> tuple[str, str, str]:
        """The prefix (up to the cursor's line), the middle (that line before the cursor) and
        the suffix: typing on a line changes only the middle, which infill puts last."""
        after = "".join(self.after)
        for i in range(len(self.before) - 1, -1, -1):
            chunk = self.before[i]
            cut = max(chunk.rfind("\n"), chunk.rfind("\r")) + 1
            if cut:
                return "".join((*self.before[:i], chunk[:cut])), "".join((chunk[cut:], *self.before[i + 1 :])), after
        return "", "".join(self.before), after


def _folders(uri: str) -> tuple[str, ...]:
    parsed = urlparse(uri)
    return tuple(p for p in unquote(parsed.path).split("/")[:-1] if p)


def _distance(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Steps from folder `a` to folder `b` in the file tree (0: the same folder)."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return len(a) + len(b) - 2 * shared


def _natural(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINTEGER:
        raise errors.invalid_params(f"{where} must be an integer from 0 to {UINTEGER}", {"field": where})
    return value


def position(value: object, where: str) -> Position:
    """An LSP Position's (line, character); -32602 naming the field when it is not one."""
    if not isinstance(value, dict):
        raise errors.invalid_params(f"{where} must be an object with line and character", {"field": where})
    return _natural(value.get("line"), f"{where}.line"), _natural(value.get("character"), f"{where}.character")


def parse_edits(changes: object) -> list[Edit]:
    """didChange's contentChanges, checked whole: (range or None, text) a change."""
    if not isinstance(changes, list):
        raise errors.invalid_params("params.contentChanges must be an array", {"field": "params.contentChanges"})
    out: list[Edit] = []
    for i, change in enumerate(changes):
        where = f"params.contentChanges[{i}]"
        if not isinstance(change, dict):
            raise errors.invalid_params(f"{where} must be an object", {"field": where})
        new = change.get("text")
        if not isinstance(new, str):
            raise errors.invalid_params(f"{where}.text must be a string", {"field": f"{where}.text"})
        rng = change.get("range")
        if rng is None:
            out.append((None, new))
            continue
        if not isinstance(rng, dict):
            raise errors.invalid_params(f"{where}.range must be an object", {"field": f"{where}.range"})
        start = position(rng.get("start"), f"{where}.range.start")
        end = position(rng.get("end"), f"{where}.range.end")
        out.append(((start, end), new))
    return out


def _carried(changes: list[Any]) -> int:
    """The characters a few changes carry (what they may cost to apply)."""
    return sum(len(t) for c in changes if isinstance(c, dict) and isinstance(t := c.get("text"), str))


def apply_edits(text: Text, edits: list[Edit]) -> int:
    """Apply edits in order; how many had a range past the text's end or backwards (clamped or
    turned round, and applied)."""
    odd = 0
    for rng, new in edits:
        if rng is None:
            text.reset(new)
            continue
        (sl, sc), (el, ec) = rng
        last = text.line_count - 1
        a = text.locate(sl, sc)[0]
        b = text.locate(el, ec)[0]
        if sl > last or el > last or b < a:
            odd += 1
            a, b = min(a, b), max(a, b)
        text.replace(a, b, new)
    return odd


class Documents:
    """The open documents, their edits and their views, in arrival order (see the module's doc)."""

    def __init__(self) -> None:
        self.open: dict[str, Document] = {}
        self.jobs = Jobs()
        self.ring = Ring()  # chunks of what the editor showed (protocol/ring.py)
        self._clock = itertools.count(1)

    def _pick(self, doc: Document, line: int) -> None:
        """The ring's chunk of `doc` around `line` (inside a job)."""
        doc.line = line
        self.ring.pick(doc.filename, doc.language, doc.text, line)

    def get(self, uri: str) -> Document | None:
        return self.open.get(uri)

    def did_open(self, uri: str, language: str, version: int, text: str) -> None:
        doc = Document(uri, language, version, Text(), next(self._clock), 0, _folders(uri))
        self.open[uri] = doc
        if text:

            def job() -> None:
                doc.text.reset(text)
                self._pick(doc, 0)

            self.jobs.run(job, large=len(text) > LARGE_TEXT)

    def did_change(self, uri: str, version: int | None, changes: object) -> None:
        doc = self.open.get(uri)
        if doc is None:
            log.warning("didChange of a document that is not open: %s", clip(uri))
            return
        if version is not None:
            doc.version = version
        doc.touched = next(self._clock)
        large = not isinstance(changes, list) or len(changes) > LARGE_EDITS or _carried(changes) > LARGE_TEXT

        def job() -> None:
            try:
                edits = parse_edits(changes)
            except errors.KinferError as exc:
                log.warning("didChange of %s not applied: %s", clip(uri), exc.message)
                return
            odd = apply_edits(doc.text, edits)
            if odd:
                log.warning("didChange of %s: %d range(s) past the document's end or backwards", clip(uri), odd)
            if edits:
                rng = edits[-1][0]
                self._pick(doc, rng[0][0] if rng is not None else 0)

        self.jobs.run(job, large=large)

    def did_save(self, uri: str) -> None:
        doc = self.open.get(uri)
        if doc is not None:
            self.jobs.run(lambda: self._pick(doc, doc.line), large=False)

    def did_close(self, uri: str) -> None:
        self.open.pop(uri, None)  # jobs still queued for it change a text nobody reads

    def relevant(self, doc: Document) -> list[Document]:
        """The other open documents of `doc`'s language, the most relevant first, at most
        OPEN_FILES: those edited or completed in, latest first; then the others, nearest to `doc`
        in the file tree first (the same folder, then one step away...), latest opened first."""
        return heapq.nlargest(
            OPEN_FILES,
            (d for d in self.open.values() if d is not doc and d.language == doc.language),
            key=lambda d: (d.touched, -_distance(d.folders, doc.folders), d.opened),
        )

    def view(
        self,
        doc: Document,
        line: int,
        character: int,
        extra: Iterable[Document] = (),
        *,
        ring: bool = False,
        insert: tuple[Position, str] | None = None,
    ) -> Pending[View]:
        """`doc` seen from an LSP position, with the text of `extra` (most relevant first) within
        OPEN_FILES_CHARS, as they are once every job before this one has run; with `ring`, the
        ring's chunks (not those of `extra`, of `doc` only those far from the cursor) before them. `insert`: (a position
        before the cursor, a text) the view takes as typed in place of what lies between them
        (an inline completion's selected item)."""
        doc.touched = next(self._clock)
        extra = list(extra)

        def job() -> View:
            at, cl, cc = doc.text.locate(line, character)
            self._pick(doc, cl)
            if ring:
                self.ring.pick_far(doc.filename, doc.language, doc.text, cl)
            before, after = doc.text.split(at)
            start: Position | None = None
            if insert is not None:
                a, sl, sc = doc.text.locate(*insert[0])
                if a > at:
                    a, sl, sc = at, cl, cc
                start = (sl, sc)
                before = [*doc.text.split(a)[0], insert[1]]
            tail, n = [], 0
            for chunk in reversed(before):
                tail.append(chunk)
                n += len(chunk)
                if n >= WORD:
                    break
            near = "".join(reversed(tail))[-WORD:]
            i = len(near)
            while i > 0 and (near[i - 1].isalnum() or near[i - 1] == "_"):
                i -= 1
            others: list[tuple[str, str]] = []
            left = OPEN_FILES_CHARS
            for d in extra:
                if left <= 0:
                    break
                body = d.text.tail(left)
                others.append((d.filename, body))
                left -= len(body)
            whole = {d.filename for d in extra}
            chunks = self.ring.extra(doc.language, whole, (doc.filename, cl)) if ring else []
            return View(tuple(before), tuple(after), cl, cc, near[i:], (*chunks, *reversed(others)), start)

        return self.jobs.result(job)

    def settled(self) -> Pending[None]:
        """Ready once every job given before it has run (for tests)."""
        return self.jobs.result(lambda: None)
