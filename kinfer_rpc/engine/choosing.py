"""Token choosing: the rows of a pass in, tokens out.

The engine hands a `Chooser` a pass's logits (or the device's argmax) and the jobs that own its
rows, and gets back each row's token: the argmax of a plain row, a sampled row's pick, a greedy
row's pick under its grammar's mask. The Chooser also keeps the device's argmax in step with the
slots' requests (DeviceGreedy, DeviceArgmax); it never decodes or touches a KV cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable
from typing import cast

import numpy as np

from kinfer_rpc.engine import CPUS, grammar
from kinfer_rpc.engine.job import Job
from kinfer_rpc.engine.sampling import SamplingOptions, logprob, sample, sample_many
from kinfer_rpc.types import DeviceArgmax, DeviceGreedy, LoadedModel, SeqChunk

_ARGMAX_PARTS = 4  # at most: the engine's thread and 3 of the pool (see Chooser.argmax)
log = logging.getLogger(__name__)


def picks_best(opts: SamplingOptions) -> bool:
    """Whether sampling with these options takes the row's best token (greedy, no penalty): a
    masked row's token is then best_allowed's, found without masking the row."""
    return opts.temperature <= 0 and opts.repeat_penalty == 1.0


def output_rows(chunks: Iterable[SeqChunk], flags: Iterable[bool]) -> list[bool]:
    """Each logits row's flag: a chunk's flag repeated for each of its outputs."""
    rows: list[bool] = []
    for chunk, flag in zip(chunks, flags):
        rows.extend([flag] * chunk.outputs)
    return rows


class Chooser:
    """Chooses the tokens of a pass's rows. `ends(job, token)`: whether the token ends the job's
    reply (its logprob is then not kept)."""

    def __init__(self, ends: Callable[[Job, int], bool]) -> None:
        self._ends = ends
        self.model: LoadedModel | None = None
        self.greedy: dict[int, bool] | None = None  # slot -> whether the device takes its argmax
        # slot -> whether the device takes its argmax while its logits come back too (DeviceArgmax)
        self.masked: dict[int, bool] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # threads for the argmax of large passes
        self._masks: grammar.Masks | None = None  # made at the first constrained pass

    def load(self, model: LoadedModel) -> None:
        """Set up for a loaded model: the device takes the argmax where it can (mlx, llama when
        patched)."""
        self.model = model
        self.greedy = {} if isinstance(model, DeviceGreedy) and model.device_greedy else None
        self.masked = {} if self.greedy is not None and isinstance(model, DeviceArgmax) else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # -- the device's argmax -----------------------------------------------------------------
    def sync(self, active: Iterable[Job]) -> None:
        """Ask the backend to take the argmax on the device for slots running greedy requests:
        then a pass of greedy requests copies token ids back instead of every row's logits. A
        slot keeps its setting while idle; it changes only when a request of the other kind
        takes it (each change costs the backend a new graph plan)."""
        greedy = self.greedy
        if greedy is None:
            return
        jobs = list(active)
        model = cast(DeviceGreedy, self.model)  # greedy is set only for a DeviceGreedy model
        for job in jobs:
            want = job.plain
            if greedy.get(job.slot) != want:
                if not model.set_device_greedy(job.slot, want) and want:
                    # Every row's logits must come back again: no slot may stay sampled there.
                    log.warning("the backend cannot take the argmax on its device; taking it here")
                    for slot, on in greedy.items():
                        if on:
                            model.set_device_greedy(slot, False)
                    self.greedy = None
                    self._drop_argmax()
                    return
                greedy[job.slot] = want
        if self.masked is None:
            return
        # A greedy row held to a grammar tries the device's argmax against its mask first.
        device = cast(DeviceArgmax, self.model)
        for job in jobs:
            want = job.greedy and not job.plain
            if self.masked.get(job.slot) != want:
                if not device.set_device_argmax(job.slot, want) and want:
                    log.warning("the backend cannot take a masked row's argmax on its device; taking it here")
                    self._drop_argmax()
                    return
                self.masked[job.slot] = want

    def _drop_argmax(self) -> None:
        """Take every masked row's argmax here from now on (the backend refused one)."""
        argmax, self.masked = self.masked, None
        if argmax:
            device = cast(DeviceArgmax, self.model)
            for slot, on in argmax.items():
                if on:
                    device.set_device_argmax(slot, False)

    def best(self, logits: np.ndarray, chunks: list[SeqChunk], owners: list[Job], plain: list[bool]) -> list[int]:
        """Each row's argmax where some row reads it (`plain` rows, and greedy rows held to a
        grammar where the device took their argmax); -1s otherwise."""
        if any(plain) or (self.masked and any(self.masked.get(job.slot) for job in owners)):
            return self.argmaxes(logits, plain, chunks)
        return [-1] * len(logits)

    def argmaxes(self, logits: np.ndarray, plain: list[bool], chunks: list[SeqChunk]) -> list[int]:
        """Each row's argmax: from the device where it took it, else computed here."""
        if self.greedy is None:
            return self.argmax(logits)
        best = cast(DeviceGreedy, self.model).sampled_tokens()  # greedy is set only for a DeviceGreedy model
        missing = [i for i, t in enumerate(best) if t < 0]
        if missing:
            # Rows of slots the device does not sample; their logits were copied back.
            rows = output_rows(chunks, plain)
            for i in missing:
                if rows[i]:
                    best[i] = int(logits[i].argmax())
        return best

    def argmax(self, logits: np.ndarray) -> list[int]:
        """Row-wise argmax. It is on the step's critical path (the device waits for it) and
        bound by memory bandwidth: a big pass (128 rows of a 32k vocabulary are 16 MB) is split
        over up to _ARGMAX_PARTS threads, this one taking a part too (numpy lets go of the GIL); a small one
        stays on this thread, where handing parts out would cost more than it saves (measured
        on the H200's host: 128 rows 0.69 ms on one thread, 0.33 on 4, 0.52 on 8)."""
        parts = min(_ARGMAX_PARTS, CPUS, logits.size >> 19)
        if parts <= 1 or logits.shape[0] < 2 * parts:
            best: list[int] = logits.argmax(axis=1).tolist()
            return best
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(_ARGMAX_PARTS - 1, "kinfer-argmax")
        rows = logits.shape[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        futures = [self._pool.submit(np.argmax, logits[a:b], 1) for a, b in zip(bounds[1:], bounds[2:])]
        first = logits[: bounds[1]].argmax(axis=1)
        best = np.concatenate([first] + [f.result() for f in futures]).tolist()
        return best

    # -- grammars ----------------------------------------------------------------------------
    def prepare_masks(self, chunks: list[SeqChunk], owners: list[Job], n_vocab: int) -> None:
        """The grammar masks of the rows of the pass in flight, computed while the device runs it.
        A row after a draft token gets its mask when its turn comes (Chooser.sample)."""
        jobs = [job for chunk, job in zip(chunks, owners) if chunk.outputs and job.constraint is not None]
        if not jobs:
            return
        if self._masks is None:
            self._masks = grammar.Masks(n_vocab)
        n_vocab = self._masks.n_vocab
        for job, bits in zip(jobs, self._masks.compute([job.constraint for job in jobs])):
            job.mask = bits
            # Only a greedy row chooses by its allowed ids (best_allowed); a sampled one masks its row.
            job.mask_ids = grammar.sparse_ids(bits, n_vocab) if picks_best(job.options.sampling) else None

    def hold_rows(self, owners: list[Job], logits: np.ndarray, best: list[int]) -> list[tuple[int, int]]:
        """In a pass of greedy rows (one a job), choose the tokens of the rows held to a grammar,
        all at once: `best` and job.held get them (-1 and None where choosing failed: the row is
        then sampled in its turn, which fails the job with the grammar's error). Returns the
        (row, token) pairs whose matchers have yet to consume them (consume_held); a row that
        took sampling's own way (no mask, or NaNs in the row) has consumed its token already."""
        rows = [r for r, job in enumerate(owners) if job.constraint is not None and job.stop_reason is None]
        picks = [(r, m, owners[r].mask_ids) for r in rows if (m := owners[r].mask) is not None]
        # The rows' own best tokens, where the device took them (DeviceArgmax), else -1.
        known = [best[r] for r, _, _ in picks]
        tokens = dict(zip((r for r, _, _ in picks), self._masks.choose(logits, picks, known))) if self._masks else {}
        chosen: list[tuple[int, int]] = []
        for r in rows:
            job = owners[r]
            own, best[r] = best[r], -1  # until chosen
            token = tokens.get(r)
            job.mask = job.mask_ids = None
            if token is None:  # (no mask computed, or NaNs in the row: sampling's own way)
                try:
                    token = self.sample(job, logits[r], first=True, best=own)
                except Exception:
                    continue
            else:
                chosen.append((r, token))
            job.held = best[r] = token
        return chosen

    def consume_held(self, owners: list[Job], chosen: list[tuple[int, int]]) -> None:
        """The matchers of hold_rows's rows consume their tokens, on llguidance's threads, while
        the next pass runs: each token is one its mask allowed, so this only moves the grammar
        on. Where that fails the row is sampled in its turn, which ends the job with the
        grammar's error; a grammar that is complete ends its job when the pass is taken. Either
        way the row the next pass gave that job is thrown away, as a stop string's is."""
        if not chosen:
            return
        assert self._masks is not None, "masks were computed for these rows"
        consumed = self._masks.consume([(owners[r].constraint, token) for r, token in chosen])
        for (r, _), ok in zip(chosen, consumed):
            if not ok:
                owners[r].held = None

    # -- sampling ----------------------------------------------------------------------------
    def sample_rows(self, chunks: list[SeqChunk], owners: list[Job], logits: np.ndarray) -> dict[int, int]:
        """The tokens of the pass's sampled rows that need nothing but their own options (one
        output, no grammar, no drafts), all at once (sampling.sample_many): row -> token. A row
        whose sampling fails is sampled again in its turn, which fails its job alone."""
        picked: list[tuple[int, Job]] = []
        row = 0
        for chunk, job in zip(chunks, owners):
            if (
                chunk.outputs == 1
                and not job.plain
                and job.constraint is None
                and not job.drafts
                and job.held is None
                and job.stop_reason is None
            ):
                picked.append((row, job))
            row += chunk.outputs
        if not picked:
            return {}
        histories = [job.prompt + job.generated for _, job in picked]
        try:
            tokens = sample_many(
                [logits[r] for r, _ in picked],
                histories,
                [len(h) for h in histories],
                [job.options.sampling for _, job in picked],
            )
        except Exception:  # noqa: BLE001 - each row is sampled alone instead, failing only its own job
            return {}
        return {r: token for (r, _), token in zip(picked, tokens)}

    def token(self, job: Job, row: np.ndarray, i: int, plain: bool, best: int, presampled: int | None) -> int:
        """The token of a job's output `i` of a pass: its argmax if `plain`, the token held for
        it (hold_rows), the one `presampled` with the pass's others (sample_rows), or sampled now.
        Raises when sampling fails (the job's options, its grammar)."""
        if plain:
            return best
        if job.held is not None:  # chosen before the next pass started, and consumed
            token, job.held = job.held, None
            return token
        if presampled is not None:
            if job.options.logprobs is not None and not self._ends(job, presampled):
                job.logprobs.append(logprob(row, presampled, job.options.logprobs))
            return presampled
        return self.sample(job, row, first=i == 0, best=best)

    def sample(self, job: Job, row: np.ndarray, first: bool, best: int = -1) -> int:
        """Pick a row's token for a job that is not plain: its logprobs from the raw row when
        asked, its grammar's mask, then sampling; the grammar consumes the token. `best`: the
        row's argmax where the device took it (a greedy job held to a grammar), else -1."""
        matcher = job.constraint
        if matcher is None:
            history = job.prompt + job.generated
            token = sample(row, history, len(history), job.options.sampling)
        else:
            n_vocab = len(row)
            ids = job.mask_ids if first and job.mask is not None else None
            bits = job.mask if first and job.mask is not None else grammar.one_mask(matcher, n_vocab)
            job.mask = job.mask_ids = None
            opts = job.options.sampling
            picked = best if best >= 0 else None
            chosen = grammar.best_allowed(row, bits, ids=ids, best=picked) if picks_best(opts) else None
            if chosen is not None:  # greedy: what sampling the masked row gives, found faster
                token = chosen
            else:
                history = job.prompt + job.generated
                token = sample(grammar.masked(row, grammar.allowed(bits, n_vocab)), history, len(history), opts)
            if not matcher.consume_token(token):
                raise RuntimeError(f"the grammar failed: {matcher.get_error()}")
        if job.options.logprobs is not None and not self._ends(job, token):
            job.logprobs.append(logprob(row, token, job.options.logprobs))
        return token
