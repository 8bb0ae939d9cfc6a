"""The engine: a queue, a fixed number of slots, and one worker thread running the step loop.

Each step is ONE decode pass over every active sequence: one token of every running reply plus
chunks of waiting prompts (chunked prefill), at most `batch` tokens in all. Requests join between
steps; finished and cancelled ones leave at once and free their slot. The worker owns the loaded
model: every decode and KV-cache call happens on it.

The worker hands events to the host through `post(callback)`, a thread-safe function that runs
`callback` on the host's event loop; all events of one step go in one callback.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import attrs
import numpy as np

from kinfer_rpc import errors
from kinfer_rpc.engine import planning
from kinfer_rpc.engine import trace as tracing
from kinfer_rpc.engine.choosing import Chooser
from kinfer_rpc.engine.drafting import Drafter
from kinfer_rpc.engine.events import Event, close, delivery, push_text
from kinfer_rpc.engine.job import Job, JobState, Limits, Outcome
from kinfer_rpc.engine.passes import Pass, PassState, Shape
from kinfer_rpc.engine.sampling import logprob
from kinfer_rpc.engine.slots import Slots
from kinfer_rpc.types import (
    AsyncDecode,
    DecodeChained,
    DecodeNext,
    DeviceTokens,
    DraftPolicy,
    DraftSession,
    LoadedModel,
    SeqChunk,
    SessionPolicy,
    contract_problems,
)

log = logging.getLogger(__name__)


# The invariant behind the checks that the model is there: it is, from a load until the worker
# ends, which is all the time jobs are submitted and steps run.
_LOADED = "jobs are submitted and steps run only while the model is loaded"


@attrs.frozen
class EngineStats:
    """What an engine is doing, as numbers (the protocol's model/status shapes them)."""

    slots: int
    busy: int  # slots running a job
    queued: int
    cells_used: int  # the running jobs' cells and the prefix pool's
    prefix: int
    cached_tokens: int  # tokens the prefix pool keeps
    prefix_hits: int
    tokens_per_second: float  # over the last few seconds
    steps: int
    draft_tokens: int
    draft_accepted: int
    memory: dict[str, Any]


class Engine:
    """Runs one loaded model on one worker thread.

    `load(progress)` is called on the worker to get the LoadedModel; `post(fn)` runs fn on the
    host's event loop. `ready` is set (through post) once the model is loaded or failed.
    """

    def __init__(
        self,
        load: Callable[[Callable[[float], None]], LoadedModel],
        post: Callable[[Callable[[], None]], object],
        *,
        batch: int = 2048,
        max_queue: int = 4096,
        prefix: int = -1,
        on_progress: Callable[[float], None] | None = None,
        on_ready: Callable[[Exception | None], None] | None = None,
        on_failed: Callable[[Exception], None] | None = None,
        draft_session: Callable[[SessionPolicy, LoadedModel], DraftSession] | None = None,
        draft_policy: DraftPolicy | None = None,
        start_ahead: bool | None = None,
    ):
        self._load = load
        # Draft policies that draft for all requests at once (a draft model, an MTP head) get
        # one session per load, made on the worker thread by `draft_session(policy, model)`.
        self.drafter = Drafter(draft_session)
        self._default_policy = draft_policy  # the load's: its session starts with the load
        self._limits = Limits(frozenset(), 0)  # set at load: the model's end tokens and context
        self.chooser = Chooser(lambda job, token: self._limits.ends(job, token))  # the rows' tokens
        self._decode_next = False  # set at load: whether the model has decode_next
        self._decode_chained = False  # set at load: whether the model has decode_chained
        self._post = post
        self.batch = batch
        self.max_queue = max_queue
        self.prefix = prefix  # tokens of finished conversations kept (-1: none, and compaction)
        self._on_progress = on_progress
        self._on_ready = on_ready
        # A step failed (a device error, e.g. out of memory): the engine answered every job with
        # it, closed the model and told on_failed; it takes no more jobs.
        self.failure: Exception | None = None
        self._on_failed = on_failed
        self._holds = 0  # hold() blocks open: the model is closed once none is left
        self.model: LoadedModel | None = None
        self.template: str | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        # work for the worker between steps (call()): an embedding model's passes
        self._calls: collections.deque[tuple[Callable[[LoadedModel], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._active: list[Job] = []  # in admission order
        self._pending: list[Job] = []  # jobs with tokens taken but not yet turned into text
        self.slots: Slots | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kinfer-engine", daemon=True)
        # (time, tokens generated) per step
        self._decoded: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        # Start a pass before taking the last one's tokens (_start_next): None follows the
        # model (its decode_async); False never (a reference to compare with, benchmarks).
        self.start_ahead = start_ahead
        self._ahead = False
        self._queued_passes = False  # set at load: see _fair_rows
        # The pass started ahead by _start_next (AHEAD), which the next step takes instead of planning
        self._running: Pass | None = None
        # A pass chained on the device to the one in flight (decode_chained, CHAINED): its
        # chunks are those of the pass it extends, one token further.
        self._chained: Pass | None = None
        self.started_ahead = 0  # passes started before the last one's tokens were taken
        self.steps = 0
        self._trace: tracing.Trace | None = None  # KINFER_TRACE: where a round's time goes
        # More than one connection is open on this model's host: see _next_waiting (set by the host).
        self.share = False

    # -- host side (any thread) -------------------------------------------------------------
    def start(self) -> None:
        # Native loaders (CUDA's above all) need more stack than a thread may get by default
        # (a load segfaulted on the H200 machine); the size applies to threads started now.
        previous = threading.stack_size(64 * 1024 * 1024)
        try:
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def _alive(self) -> LoadedModel:
        """The model, unless this engine takes no more work: its step failed, or an unload has begun."""
        if self.failure is not None:
            raise errors.KinferError(errors.INTERNAL_ERROR, f"the model failed and was unloaded: {self.failure}")
        model = self.model
        if model is None or self._stopping:
            raise errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded")
        return model

    def submit(self, job: Job) -> None:
        info = self._alive().info
        if not job.prompt:
            raise errors.invalid_params("the prompt is empty (0 tokens)")
        if len(job.prompt) >= info.context_length:
            raise errors.KinferError(
                errors.CONTEXT_OVERFLOW,
                f"the prompt is {len(job.prompt)} tokens but the context holds {info.context_length}"
                f" per slot (at least one token must be left for the reply)",
                {"promptTokens": len(job.prompt), "contextLength": info.context_length},
            )
        if job.options.max_tokens == 0:  # nothing to generate: answer without a pass
            job.move(JobState.DONE)
            job.stop_reason = "length"
            job.t_start = job.t_end = time.perf_counter()
            on_done, outcome = job.on_done, Outcome.of(job)
            if on_done:
                self._post(lambda: on_done(outcome))
            return
        with self._cond:
            self._alive()  # not failed or unloaded meanwhile
            if len(self._queue) >= self.max_queue:
                raise errors.KinferError(errors.QUEUE_FULL, f"the queue is full ({self.max_queue} requests waiting)")
            self._queue.append(job)
            self._cond.notify()

    def call(self, fn: Callable[[LoadedModel], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn(model)` on the worker thread, between steps, in the order calls come (an
        embedding model's passes: the model is used only from its worker). Its result or
        exception comes back through the future; a future cancelled before it runs is dropped."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            self._alive()
            if len(self._queue) + len(self._calls) >= self.max_queue:
                raise errors.KinferError(errors.QUEUE_FULL, f"the queue is full ({self.max_queue} requests waiting)")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def _run_call(self) -> None:
        """The oldest call, if any, on the worker."""
        with self._cond:
            if not self._calls:
                return
            fn, future = self._calls.popleft()
        if not future.set_running_or_notify_cancel():
            return
        assert self.model is not None, _LOADED
        try:
            future.set_result(fn(self.model))
        except Exception as exc:
            future.set_exception(exc)

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    @contextlib.contextmanager
    def hold(self) -> Iterator[LoadedModel]:
        """The model, kept open until the block ends (an unload closes it after): for the work a
        request does with it off the engine's thread, such as tokenizing its prompt."""
        with self._cond:
            model = self._alive()
            self._holds += 1
        try:
            yield model
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def stats(self) -> EngineStats:
        info = self.model.info if self.model else None
        window = list(self._decoded)
        tps = 0.0
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            tps = sum(n for _, n in window[1:]) / (window[-1][0] - window[0][0])
        active = list(self._active)
        kept = self.slots.kept_tokens() if self.slots else 0
        return EngineStats(
            slots=info.slots if info else 0,
            busy=len(active),
            queued=len(self._queue) + len(self._calls),
            cells_used=sum(j.n_past for j in active) + kept,
            prefix=self.prefix,
            cached_tokens=kept,
            prefix_hits=self.slots.hits if self.slots else 0,
            tokens_per_second=tps,
            steps=self.steps,
            draft_tokens=self.drafter.total[0],
            draft_accepted=self.drafter.total[1],
            memory=self.model.memory() if self.model else {},
        )

    # -- worker ------------------------------------------------------------------------------
    def load_model(self) -> None:
        """Load the model on the calling thread (the worker's, or a test's driving step())."""
        progress = self._on_progress or (lambda f: None)

        def report(f: float) -> None:
            self._post(lambda: progress(f))

        self.model = self._load(report)
        problems = contract_problems(self.model, "model")
        if problems:  # a backend's bug, named, rather than a feature quietly off or a crash later
            model, self.model = self.model, None
            model.close()
            raise TypeError(f"the loaded model {type(model).__name__} {'; '.join(problems)}")
        self._trace = tracing.current()
        if self._trace is not None:
            self._trace.attach(self.model)
        self.template = self.model.chat_template()
        self.slots = Slots(self.model, self.model.info.slots, self.prefix)
        self._limits = Limits(frozenset(self.model.eog_tokens()), self.model.info.context_length)
        ahead = self.start_ahead
        if ahead is None:
            ahead = isinstance(self.model, AsyncDecode) and self.model.decode_async
        self._ahead = ahead
        # passes queued on a device (a GPU): more rows cost little, so rows are never rationed
        self._queued_passes = isinstance(self.model, AsyncDecode) and self.model.decode_async
        self.chooser.load(self.model)
        self._decode_next = isinstance(self.model, DecodeNext)
        self._decode_chained = self.chooser.greedy is not None and isinstance(self.model, DecodeChained)
        self.drafter.load(self.model, isinstance(self.model, DeviceTokens) and self.model.feeds_device_tokens)
        if isinstance(self._default_policy, SessionPolicy):
            # Now, not at the first request: a load whose policy cannot start (no draft model,
            # no MTP head) fails with the reason instead of quietly drafting nothing.
            try:
                self.drafter.session(self._default_policy)
            except BaseException:
                self.model.close()
                self.model = None
                raise

    def _run(self) -> None:
        try:
            self.load_model()
        except Exception as exc:
            if isinstance(exc, errors.KinferError):  # a load refused for a reason it names: one line
                log.warning("model load failed: %s", exc)
            else:
                log.exception("model load failed")
            if self._on_ready:
                self._post(functools.partial(self._on_ready, exc))  # `exc` is unbound after except
            return
        if self._on_ready:
            self._post(functools.partial(self._on_ready, None))
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._queue and not self._active and not self._calls:
                        self._cond.wait()
                    if self._stopping:
                        break
                    jobs = bool(self._queue or self._active)
                self._run_call()
                if jobs:
                    self.step()
        except Exception as exc:  # the device failed: answer everyone, never hang them
            log.exception("engine step failed")
            with self._cond:
                self.failure = exc  # before the jobs are failed: submit() refuses from now on
            if self._on_failed:  # posted before the answers: whoever reads one sees the model failed
                try:
                    self._post(functools.partial(self._on_failed, exc))
                except RuntimeError:  # the event loop has closed: nobody is left to tell
                    log.warning("the model failed after the event loop closed")
            self._end_running()
            self._fail_all(exc)
        finally:
            self._end_running()
            self._fail_all(errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded"))
            with self._cond:
                calls = list(self._calls)
                self._calls.clear()
            for _fn, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded"))
            self.drafter.close()
            with self._cond:
                model, self.model = self.model, None  # no new holds from here
                while self._holds:  # a request tokenizing with it: close it after
                    self._cond.wait()
            if model is not None:
                model.close()
            self.chooser.close()

    def _end_running(self) -> None:
        """Wait for a pass started ahead, if any (its tokens are dropped): slots are freed and
        the model closed only once the device is done with it."""
        running, self._running = self._running, None
        if running is not None:
            running.drop()
        self._drop_chained()
        if self.drafter.on_device and self.model is not None:  # fed to a pass never taken: the session settles them
            self.drafter.read(self.model.info.n_vocab)

    def _chain(self, current: Pass) -> None:
        """Right after launching a chainable pass: chain the next one to it on the device
        (decode_chained), to be used or dropped once this one's tokens are taken (_start_next)."""
        assert self.model is not None, _LOADED
        try:  # _decode_chained: the model was a DecodeChained at load
            wait = cast(DecodeChained, self.model).decode_chained()
        except ValueError:  # not a pass it can extend (its rows, its room): nothing chained
            self._chained = None
            return
        self._chained = Pass(current.chunks, current.owners, wait, PassState.CHAINED, current.shape)

    def _drop_chained(self) -> None:
        """A chained pass not used: wait for it, then remove the cells it wrote (one a row, after
        the rows of the pass it extends)."""
        chained, self._chained = self._chained, None
        if chained is None:
            return
        chained.drop()
        model = self.model
        if model is not None:
            for chunk in chained.chunks:
                model.seq_remove(chunk.seq, chunk.pos + 1, -1)

    def _fail_all(self, exc: Exception) -> None:
        events: list[Event] = []
        with self._cond:
            jobs = list(self._active) + list(self._queue)
            self._active.clear()
            self._queue.clear()
        for job in jobs:
            if job.state is JobState.DONE:  # ended already, its slot not yet given back
                continue
            job.error = exc
            self._finish(job, None, events)
        self._flush(events)

    def step(self) -> bool:
        """One step: drop cancelled jobs, admit waiting ones, run one pass. False if idle.

        The pass may already be running: the previous step started it (see _start_next)."""
        events: list[Event] = []
        running, self._running = self._running, None
        ended = list(running.ended) if running is not None else []
        with self._cond:
            # Leave: cancelled jobs free their slot before anything runs (or once the pass
            # already running, which holds their row, is done; the row is thrown away).
            # (A job that ended while the pass in flight holds its row is done already.)
            for job in [j for j in self._active if j.cancelled and j.state is not JobState.DONE]:
                self._finish(job, "cancelled", events, release=running is None)
                if running is not None:
                    ended.append(job)
            for job in [j for j in self._queue if j.cancelled]:
                self._queue.remove(job)
                self._finish(job, "cancelled", events)
            if running is None:
                # Join: each waiting job takes a slot (and whatever prefix the pool holds for it).
                slots = self.slots
                assert slots is not None, _LOADED
                while (joining := self._next_waiting()) is not None:
                    self._queue.remove(joining)
                    joining.t_start = time.perf_counter()
                    slots.take(joining, self._active)
                    joining.move(JobState.PROMPT)
                    self._active.append(joining)
                slots.compact(self._active)
                self.chooser.sync(self._active)
        model = self.model
        assert model is not None, _LOADED
        current = running
        if current is None:
            plan = self._plan()
            current = (
                Pass(plan.chunks, plan.owners, model.decode(plan.chunks), PassState.PLANNED, plan.shape)
                if plan.chunks
                else None
            )
        if current is not None and current.shape is Shape.CHAINABLE and self._decode_chained:
            self._chain(current)
        try:
            # While the device runs this pass, turn the previous step's tokens into text. A stop
            # string found now ends its job; the token the job has in this pass is thrown away.
            ended += self._drain_text(events)
            if current is not None:
                self.chooser.prepare_masks(current.chunks, current.owners, model.info.n_vocab)
                logits = current.take()
                self.steps += 1
                self._take(current, logits, events)
            self._drop_chained()  # not used by _take's _start_next (normally none is left)
            for job in ended:
                self._release(job)
        finally:
            if current is not None and current.state is not PassState.TAKEN:
                # failed before its wait: the pass must end before anything goes
                current.ended = []
                self._running = current
            self._flush(events)
        return current is not None

    def _next_waiting(self) -> Job | None:
        """The waiting job that takes the next free slot, if one may (planning.next_waiting)."""
        slots = self.slots
        assert slots is not None, _LOADED
        return planning.next_waiting(self._queue, self._active, len(slots.free), self.share)

    def _plan(self) -> planning.Plan:
        """The next pass's rows (planning.plan)."""
        assert self.model is not None, _LOADED
        held = planning.held_by_owner(self._active, self.share, self._queued_passes)
        return planning.plan(
            self.model,
            self._active,
            batch=self.batch,
            held=held,
            step=self.steps,
            ahead=self._ahead,
            drafter=self.drafter,
        )

    def _take(self, current: Pass, logits: np.ndarray, events: list[Event]) -> None:
        """Choose the token of every row that asked for logits; the text work waits for the next pass."""
        chunks, owners, chooser = current.chunks, current.owners, self.chooser
        assert self.model is not None, _LOADED
        self.drafter.read(self.model.info.n_vocab)
        # Greedy rows without a penalty are one argmax over the whole pass, not one per row.
        plain = [job.plain for job in owners]
        best = chooser.best(logits, chunks, owners, plain)
        if current.shape.steady:
            # Every row one greedy token: those held to a grammar are chosen now, so that the
            # next pass can start before the rest of the bookkeeping; their matchers consume
            # the tokens once it runs.
            chosen = chooser.hold_rows(owners, logits, best)
            self._start_next(current, best)
            chooser.consume_held(owners, chosen)
        else:
            self._drop_chained()
        # A job that ends here while the next pass holds its row keeps its slot until that pass is done.
        ahead = self._running is not None
        presampled = chooser.sample_rows(chunks, owners, logits)
        row = 0
        produced = 0
        now = time.perf_counter()
        for chunk, job, is_plain in zip(chunks, owners, plain):
            job.n_past += len(chunk.tokens)
            if job.state is JobState.PROMPT and job.n_past >= len(job.prompt):
                job.move(JobState.GENERATING)
            if not chunk.outputs:
                continue
            r, row = row, row + chunk.outputs
            if job.stop_reason is not None:  # ended by a stop string while this pass ran
                continue
            if not job.t_first:
                job.t_first = now
            if job.thinking is not None and (forced := job.thinking.next_forced()) is not None:
                # the end of a reasoning block whose budget is spent: taken, not sampled (no drafts)
                if job.options.logprobs is not None:
                    job.logprobs.append(logprob(logits[r], forced, job.options.logprobs))
                produced += 1
                self._append(job, forced, job.n_past, events)
                continue
            if is_plain and chunk.outputs == 1 and not job.drafts:  # the usual row: its argmax
                produced += 1
                self._append(job, best[r], job.n_past, events)
                continue
            base = job.n_past - len(chunk.tokens)  # position of the chunk's first token
            # Verify drafts in order: the token sampled at each position, from that position's
            # own random stream, must equal the draft; the first that differs is kept instead.
            # So the reply is exactly what decoding one token at a time would give.
            taken = 0
            for i in range(chunk.outputs):
                try:
                    token = chooser.token(job, logits[r + i], i, is_plain, best[r + i], presampled.get(r + i))
                except Exception as exc:  # one request's options must not stop the engine
                    log.exception("sampling failed")
                    job.error = errors.KinferError(errors.INVALID_PARAMS, f"sampling failed with these options: {exc}")
                    self._end_job(job, None, events, ahead)
                    break
                produced += 1
                taken += 1
                # The sampled token will sit right after the row's own token.
                next_pos = base + len(chunk.tokens) - chunk.outputs + i + 1
                if not self._append(job, token, next_pos, events, logits[r + i] if not is_plain else None):
                    break
                if job.thinking is not None and job.thinking.changed:
                    # the reasoning block closed (its constraint holds the next token) or its end
                    # is forced from here: outputs drafted past this one are not taken
                    break
                if job.constraint is not None and job.constraint.is_stopped():
                    # The grammar is complete: nothing but the end of generation may follow.
                    self._text(job, events)
                    self._end_job(job, "stop", events, ahead)
                    break
                if i >= len(job.drafts) or token != job.drafts[i]:
                    break
            if job.drafts:
                self._settle_drafts(job, base, taken)
        self._decoded.append((now, produced))

    def _end_job(self, job: Job, reason: str | None, events: list[Event], ahead: bool) -> None:
        """_finish, its slot given back after the pass started ahead when one holds its row."""
        running = self._running if ahead else None
        held = running is not None and running.holds(job)
        self._finish(job, reason, events, release=not held)
        if held:
            assert running is not None
            running.ended.append(job)

    def _settle_drafts(self, job: Job, base: int, taken: int) -> None:
        """After verifying a job's drafts: the drafter counts them; the cells of the rejected
        ones go."""
        end = self.drafter.settle(job, base, taken)
        if end is not None:
            assert self.model is not None, _LOADED
            self.model.seq_remove(job.slot, end, -1)

    def _start_next(self, current: Pass, best: list[int]) -> None:
        """Start the next pass now, before this one's tokens are taken, when it is exactly the
        pass the next step would plan: every row a greedy job's one token, none of them ending
        here (end-of-generation, max_tokens, the context), none cancelled or stopped, nobody
        waiting to join and no slot to move. The device then runs it while this thread does
        the bookkeeping, the text and the events; the rows and their positions are the same,
        so the reply is too. A job cancelled or ended by a stop string meanwhile has its row
        thrown away, as a stop string's always was.

        A pass chained to this one on the device (decode_chained, see _chain) is that next pass
        already running, fed with the same tokens: it is used when the next pass is the one the
        next step would plan, and dropped otherwise."""
        model, slots = self.model, self.slots
        assert model is not None and slots is not None, _LOADED
        chunks, owners = current.chunks, current.owners
        if not self._next_is(chunks, owners, best):
            self._drop_chained()  # before any slot is given back: its cells go first
            return
        nxt = [SeqChunk(chunk.seq, chunk.pos + 1, (token,), 1) for chunk, token in zip(chunks, best)]
        chained, self._chained = self._chained, None
        if chained is not None:  # already running on the device, fed with these very tokens
            chained.chunks, chained.owners = nxt, owners
            chained.move(PassState.AHEAD)
            self._running = chained
        else:
            # The device waits from the last pass's end until this call: a backend that can
            # repeat the last pass one token further (decode_next) is spared reading chunks,
            # which are built once the pass runs. (_decode_next: a DecodeNext at load)
            nexted = cast(DecodeNext, model).decode_next(best) if self._decode_next else None
            self._running = Pass(nxt, owners, nexted or model.decode(nxt), PassState.AHEAD, current.shape)
        self.started_ahead += 1

    def _next_is(self, chunks: list[SeqChunk], owners: list[Job], best: list[int]) -> bool:
        """Whether the next step would plan exactly these rows one token further, fed `best`."""
        slots = self.slots
        assert slots is not None, _LOADED
        if self._next_waiting() is not None:  # someone joins at the next step
            return False
        return slots.settled(owners) and planning.steps_on(chunks, owners, best, self._limits)

    def _append(self, job: Job, token: int, next_pos: int, events: list[Event], row: np.ndarray | None = None) -> bool:
        """Take one sampled token (to be fed at `next_pos`); False when it ended the job. `row`:
        the token's logits, where the job has them (the logprob of a token taken in its place)."""
        thinking = job.thinking
        if self._limits.ends(job, token):
            if thinking is None or not thinking.holds_end():
                self._text(job, events)
                self._finish(job, "stop", events)
                return False
            # a reply held to a constraint does not end inside its reasoning: the block ends instead
            token = thinking.close_now(job.generated)
            if job.options.logprobs is not None and row is not None:
                job.logprobs.append(logprob(row, token, job.options.logprobs))
        job.generated.append(token)
        if thinking is not None:
            thinking.changed = thinking.took(job.generated)
            if thinking.changed and not thinking.inside:
                job.reasoned()
        if not self._pending or self._pending[-1] is not job:
            self._pending.append(job)
        if self._limits.full(job, len(job.generated), next_pos):
            self._finish(job, "stop" if self._text(job, events) else "length", events)
            return False
        return True

    def _drain_text(self, events: list[Event]) -> list[Job]:
        """Text of the tokens taken last step; returns the jobs a stop string ended."""
        pending, self._pending = self._pending, []
        ended: list[Job] = []
        for job in pending:
            if job.stop_reason is None and self._text(job, events):
                self._finish(job, "stop", events, release=False)
                ended.append(job)
        return ended

    def _text(self, job: Job, events: list[Event]) -> bool:
        """Push the job's tokens not yet turned into text; True if a stop string ended it."""
        assert self.model is not None, _LOADED
        return push_text(job, self.model.token_bytes, events)

    def _finish(self, job: Job, reason: str | None, events: list[Event], release: bool = True) -> None:
        """End the job (events.close); its slot goes back unless a pass in flight holds its row."""
        close(job, reason, events, self._trace)
        if release:
            self._release(job)

    def _release(self, job: Job) -> None:
        """Give the job's slot back (after any pass it was part of has finished)."""
        if job in self._active:
            self._active.remove(job)
            if self.model is not None:
                assert self.slots is not None, "the slots are made with the model"
                self.slots.give_back(job, self._active)

    def _flush(self, events: list[Event]) -> None:
        if events:
            self._post(delivery(events))
