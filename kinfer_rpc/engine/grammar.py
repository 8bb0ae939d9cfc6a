"""Replies held to a JSON schema, a grammar or a regular expression, through llguidance.

llguidance (https://github.com/guidance-ai/llguidance) compiles a schema, a Lark-style grammar or
a regex against a model's vocabulary and tells, at every step, which tokens may come next: a
bitmask over the vocabulary. The engine applies the mask to that request's row of logits before
sampling, then has the request's matcher consume the chosen token. Everything here works from
what every LoadedModel offers (token_bytes, tokenize, eog_tokens), so any backend that returns
logits can constrain its replies.

A mask depends only on the request's own tokens, so a constrained reply is as reproducible as
any other: alone or among others, drafting on or off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import llguidance
import llguidance.numpy
import numpy as np

from kinfer_rpc import errors
from kinfer_rpc.engine import CPUS, IDLE_AFTER_SECONDS, grammar_limits, on_idle_cpu
from kinfer_rpc.types import LoadedModel

_THREADS = max(1, min(32, CPUS))
log = logging.getLogger(__name__)


class _Vocab:
    """What llguidance's TokenizerWrapper reads: every token's bytes (control tokens marked with
    a leading 0xff, as llguidance's own llama.cpp adapter marks them), the end tokens, and a
    tokenize function (for grammars that hold literal text)."""

    def __init__(self, model: LoadedModel):
        n = model.info.n_vocab
        eog = sorted(model.eog_tokens())
        self.eos_token_id = eog[0] if eog else 0
        self.bos_token_id = None
        self.special_token_ids: list[int] = []
        tokens: list[bytes] = []
        for t in range(n):
            piece = model.token_bytes(t)
            if t in eog or _looks_special(piece) and _is_special(model, t, piece):
                self.special_token_ids.append(t)
                piece = b"\xff" + piece
            tokens.append(piece)
        self.tokens = tokens
        self._model = model
        # A SentencePiece vocabulary puts a space in front of the text it tokenizes; llguidance
        # needs the text's own tokens (it forces them where a grammar allows nothing else). Then
        # the text is tokenized after a marker that merges with nothing, and the marker's
        # tokens are dropped.
        self._marker: list[int] = []
        if self._spelt("a") != b"a":
            self._marker = model.tokenize(_MARKER, False, False)

    def _spelt(self, text: str) -> bytes:
        return b"".join(self._model.token_bytes(t) for t in self._model.tokenize(text, False, False))

    def __call__(self, text: bytes) -> list[int]:
        s = text.decode("utf-8", "replace")
        if not self._marker:
            return self._model.tokenize(s, False, False)
        ids = self._model.tokenize(_MARKER + s, False, False)
        n = len(self._marker)
        return ids[n:] if ids[:n] == self._marker else ids


_MARKER = "\x01"


def _looks_special(piece: bytes) -> bool:
    return len(piece) > 2 and (piece[:1], piece[-1:]) in {(b"<", b">"), (b"[", b"]")}


def _is_special(model: LoadedModel, token: int, piece: bytes) -> bool:
    """A control token: its text reads back as itself only when special tokens are parsed."""
    text = piece.decode("utf-8", "replace")
    return model.tokenize(text, False, False) != [token] and model.tokenize(text, False, True) == [token]


class Unmaskable(Exception):
    """The model's vocabulary cannot be read for masking (the backend's error, as text)."""


class Grammars:
    """The constraint compiler of one loaded model. Building its llguidance tokenizer walks the
    whole vocabulary (tens of milliseconds to a second), so it is built at the first constrained
    request, on the thread that compiles that request (never the event loop), and kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._unusable: str | None = None  # why the model's vocabulary cannot be masked, once found

    def tokenizer(self, model: LoadedModel) -> llguidance.LLTokenizer:
        """The model's llguidance tokenizer, built once; Unmaskable when its vocabulary cannot be
        read (the first failure is kept: the vocabulary is not walked again for each request)."""
        with self._lock:
            if self._unusable is not None:
                raise Unmaskable(self._unusable)
            if self._tokenizer is None:
                try:
                    vocab = _Vocab(model)
                    eos = [t for t in vocab.special_token_ids if t in model.eog_tokens()] or [vocab.eos_token_id]
                    self._tokenizer = llguidance.LLTokenizer(
                        llguidance.TokenizerWrapper(vocab), n_vocab=model.info.n_vocab, eos_token=eos
                    )
                except MemoryError:
                    raise  # the machine's state, not the vocabulary's: the next request tries again
                except Exception as exc:
                    log.exception("building the grammar tokenizer failed")
                    self._unusable = f"{type(exc).__name__}: {exc}"
                    raise Unmaskable(self._unusable) from exc
            return self._tokenizer

    def matcher(self, model: LoadedModel, kind: str, source: Any) -> llguidance.LLMatcher:
        """A fresh matcher for one request; -32602 naming the limit when the schema, grammar or
        regex is over one of kinfer_rpc.engine.grammar_limits' (checked here for all but the
        tools' grammar, whose schemas are checked as the request is read), with llguidance's
        message when it does not compile, or when the model's vocabulary cannot be read for
        masking (a plugin backend whose token_bytes or tokenize fails). It compiles on a thread
        of its own with a large stack (on_compile_stack)."""
        if kind != "tools":
            grammar_limits.check(kind, source, option_field(kind))
        return on_compile_stack(lambda: self._compile(model, kind, source))

    def _compile(self, model: LoadedModel, kind: str, source: Any) -> llguidance.LLMatcher:
        grammar = source_grammar(kind, source)
        try:
            tokenizer = self.tokenizer(model)
        except Unmaskable as exc:
            field = option_field(kind)
            raise errors.invalid_params(
                f"{field} cannot apply to this model: its vocabulary cannot be read for masking ({exc})",
                {"field": field, "error": str(exc)},
            ) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise compile_error(kind, matcher.get_error())
        return matcher


_T = TypeVar("_T")
_stack_size = threading.Lock()  # threading.stack_size is the process's: one thread started at a time
# Compiles running at once in the process, those whose requests were cancelled included (their
# threads end on their own); a compile past this waits for one to end
COMPILES = 8
_compiling = threading.BoundedSemaphore(COMPILES)


COMPILE_NICE = 10  # a compile thread's niceness, added to the server's (Linux: threads have their own)


def _below_the_server() -> None:
    """This thread runs COMPILE_NICE below the server's (Linux: a thread id names the thread
    alone; elsewhere it would name the process, so nothing is done): a schema that takes
    seconds to compile takes the CPU only from what the engine and the protocol leave."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE)


def on_compile_stack(compile: Callable[[], _T]) -> _T:
    """compile() on a fresh thread with COMPILE_STACK bytes of stack, waited for here.
    llguidance recurses as deep as a grammar's rules refer to each other, and a stack overflow
    ends the process; the limits (kinfer_rpc.engine.grammar_limits) keep that depth well within
    this stack. The stack is address space, not memory: only the pages a compile reaches become
    memory, and they are given back when its thread ends (glibc keeps the mapping for the next
    thread with nothing resident: 0 kB after a compile that touched 98 MiB)."""
    outcome: list[tuple[bool, Any]] = []
    tid: list[int] = []

    def run() -> None:
        try:
            tid.append(threading.get_native_id())
            _below_the_server()
            outcome.append((True, compile()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, exc))
        finally:
            _compiling.release()

    _compiling.acquire()
    with _stack_size:
        before = threading.stack_size(grammar_limits.COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="kinfer-grammar", daemon=True)
            thread.start()
        except RuntimeError as exc:  # the stack could not be mapped
            _compiling.release()
            raise errors.KinferError(
                errors.INTERNAL_ERROR, f"the grammar compiler's thread could not start: {exc}"
            ) from None
        finally:
            threading.stack_size(before)
    # A schema that takes seconds to compile cannot slow the engine's passes, the protocol, or the
    # compiles that take milliseconds.
    thread.join(IDLE_AFTER_SECONDS)
    if thread.is_alive() and tid:
        on_idle_cpu(tid[0])
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: _T = value
    return result


# Whitespace between JSON tokens as llama.cpp's json-schema-to-grammar allows it (nothing, a
# space, or one or two newlines and an indent of at most 20): unbounded, a small model can pad a
# reply with newlines until maxTokens. A schema's own "x-guidance" options override it.
JSON_OPTIONS: Any = {"whitespace_pattern": r" |\n{1,2}[ \t]{0,20}"}


def source_grammar(kind: str, source: Any) -> str:
    """The llguidance grammar of a request's `format`, `grammar` or `regex` option."""
    try:
        if kind == "format":
            # "json" is any JSON object, as Ollama's JSON mode: a bare number at the top level has
            # nothing that ends it, and a small model writes digits until maxTokens.
            schema = {"type": "object"} if source == "json" else source
            text = schema if isinstance(schema, str) else json.dumps(schema)  # a schema, or its JSON text
            return str(llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(source))
        return str(llguidance.LLMatcher.grammar_from_lark(source))
    except (ValueError, TypeError) as exc:
        raise compile_error(kind, str(exc)) from None


def option_field(kind: str) -> str:
    """The request field a constraint came from: "tools" for the grammar of forced tool calls."""
    return "tools" if kind == "tools" else f"options.{kind}"


def compile_error(kind: str, message: str) -> errors.KinferError:
    first = message.strip().splitlines()[0] if message.strip() else "it is not valid"
    field = option_field(kind)
    return errors.invalid_params(f"{field} does not compile: {first}", {"field": field, "error": message})


class Masks:
    """The next token's mask for every constrained row of a pass, computed on llguidance's
    threads (they let go of the GIL) while the device runs the pass."""

    def __init__(self, n_vocab: int):
        self.n_vocab = n_vocab
        self._executor: llguidance.LLExecutor | None = None
        self._bits = llguidance.numpy.allocate_token_bitmask(1, n_vocab)
        self.own_best = 0  # rows choose() settled by their own best token

    def compute(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """One bitmask row per matcher, in order (int32 words, bit i of the row = token i)."""
        if len(matchers) > self._bits.shape[0]:
            self._bits = llguidance.numpy.allocate_token_bitmask(len(matchers), self.n_vocab)
        bits = self._bits[: len(matchers)]
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0], bits, 0)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(self._pool(), [(m, i) for i, m in enumerate(matchers)], bits)
        return bits.copy()

    def consume(self, pairs: Sequence[tuple[llguidance.LLMatcher, int]]) -> list[bool]:
        """Each matcher consumes its token, on llguidance's threads; False where it failed."""
        if len(pairs) == 1:
            return [bool(pairs[0][0].consume_token(pairs[0][1]))]
        return [bool(ok) for ok in llguidance.numpy.consume_token_par(self._pool(), list(pairs))]

    def choose(
        self,
        logits: np.ndarray,
        picks: Sequence[tuple[int, np.ndarray, np.ndarray | None]],
        known: Sequence[int] | None = None,
    ) -> list[int | None]:
        """best_allowed(logits[r], bits, ids=ids, best=k) for each (r, bits, ids) and its `known`
        best token k (the row's argmax where the device took it, -1 where not), the same tokens,
        for a pass of held rows: the rows' unknown best tokens come from one argmax over them."""
        if not picks:
            return []
        rows = [r for r, _, _ in picks]
        out: list[int | None] = [None] * len(picks)
        rest: list[int] = []
        own = list(known) if known is not None else [-1] * len(picks)
        need = [k for k, t in enumerate(own) if t < 0]
        if need:
            sub = [rows[k] for k in need]
            block = logits if sub == list(range(len(logits))) else logits[sub]
            for k, t in zip(need, block.argmax(axis=1).tolist()):
                own[k] = t
        for k, ((r, bits, _), t) in enumerate(zip(picks, own)):
            if logits[r, t] != logits[r, t]:
                continue  # NaNs: sampling's own way (None)
            if _allows(bits, t):
                out[k] = t
            else:
                rest.append(k)
        self.own_best += len(picks) - len(rest)
        for k in rest:
            r, bits, ids = picks[k]
            out[k] = best_allowed(logits[r], bits, ids=ids, best=own[k])
        return out

    def _pool(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(_THREADS)
        return self._executor


def one_mask(matcher: llguidance.LLMatcher, n_vocab: int) -> np.ndarray:
    """The next token's mask of one matcher, computed here (rows after a draft token)."""
    bits = llguidance.numpy.allocate_token_bitmask(1, n_vocab)
    llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
    row: np.ndarray = bits[0]
    return row


def allowed(bits: np.ndarray, n_vocab: int) -> np.ndarray | None:
    """The mask as booleans over the vocabulary; None when it allows every token (nothing to
    apply)."""
    if (bits == -1).all():
        return None
    return np.unpackbits(bits.view(np.uint8), count=n_vocab, bitorder="little").view(bool)


def allowed_ids(bits: np.ndarray, n_vocab: int) -> np.ndarray:
    """The ids a mask allows, in order. A sparse mask (a few allowed tokens) unpacks only its
    non-zero words; one with many non-zero words is unpacked whole, which is faster there."""
    words = np.flatnonzero(bits)
    if len(words) * 8 > len(bits):
        return np.flatnonzero(np.unpackbits(bits.view(np.uint8), count=n_vocab, bitorder="little").view(bool))
    sub = np.unpackbits(bits[words].view(np.uint8), bitorder="little").view(bool).reshape(len(words), 32)
    w, b = np.nonzero(sub)
    ids = words[w] * 32 + b
    return ids[ids < n_vocab]


def allowed_count(bits: np.ndarray) -> int:
    """How many tokens a mask allows (bits past the vocabulary are never set)."""
    if _bitwise_count is not None:
        return int(_bitwise_count(bits.view(np.uint32)).sum())
    return int(np.count_nonzero(np.unpackbits(bits.view(np.uint8))))


_bitwise_count = getattr(np, "bitwise_count", None)  # numpy 2: a popcount a word


def _allows(bits: np.ndarray, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def sparse_ids(bits: np.ndarray, n_vocab: int) -> np.ndarray | None:
    """The ids of a mask that allows at most half the vocabulary, listed ahead of the choice
    while the device runs the pass; None for one that allows more (best_allowed tries the row's
    next best tokens there)."""
    if allowed_count(bits) * 2 > n_vocab:
        return None
    return allowed_ids(bits, n_vocab)


def best_allowed(
    row: np.ndarray, bits: np.ndarray, rounds: int = 4, ids: np.ndarray | None = None, best: int | None = None
) -> int | None:
    """The greedy token under a mask: the first of the allowed tokens with the highest logit, as
    sampling's argmax of the masked row gives it, without masking the row. Most steps of a model
    that follows its grammar, the row's own best token is allowed: one argmax and one bit. None
    where the row has NaNs (sampling's way with them decides).

    Otherwise, under a mask that allows most of the vocabulary (inside a JSON string, say), the
    next best tokens are tried on a copy of the row with each forbidden best put at -inf (an
    argmax of the rest gives the same first-highest token as one of the masked row): each try
    settles it more often than not. A mask that allows at most half the vocabulary, or a row
    still unsettled after `rounds` tries, takes the best of its allowed ids (`ids`: those
    listed beforehand by sparse_ids; `best`: the row's argmax, when known)."""
    if best is None:
        best = int(row.argmax())
    if row[best] != row[best]:
        return None
    if _allows(bits, best):
        return best
    if ids is None and allowed_count(bits) * 2 > len(row):  # most tokens allowed: a few tries settle it
        work = row.copy()
        t = best
        for _ in range(rounds):
            work[t] = -np.inf
            t = int(work.argmax())
            if work[t] == -np.inf:
                break  # the rest is -inf: the allowed ids decide the tie
            if _allows(bits, t):
                return t
    idx = allowed_ids(bits, len(row)) if ids is None else ids
    if not len(idx):
        return best  # nothing is allowed: the grammar failed, and consuming the token says so
    return int(idx[int(row[idx].argmax())])


def masked(row: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """A row of logits with the tokens a mask forbids at -inf (a copy; the row may be the
    backend's buffer)."""
    if keep is None:
        return row
    n = min(len(row), len(keep))
    out = np.full(row.shape, -np.inf, dtype=row.dtype)
    out[:n] = np.where(keep[:n], row[:n], -np.inf)
    return out
