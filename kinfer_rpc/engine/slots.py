"""Which slot a request gets, and what its KV cells already hold.

Two layouts, chosen by the load option `prefix`:

- The prefix pool (`prefix` >= 0): a slot keeps the cells of the conversation that last used it.
  A new request takes the free slot whose kept tokens share the longest prefix with its prompt
  (the cells past the shared part are dropped), or copies a busy slot's shared prefix into a
  free slot (llama.cpp copies a whole stream's buffer, then the tail is dropped). `prefix` caps the
  tokens kept for finished conversations; the least recently used go first.
- Per-slot streams with compaction (`prefix` -1): nothing is kept; a freed slot goes to the next
  waiting request, and a gap no request fills is closed by moving the busy slot with the highest
  id into it, one move a step, so busy ids run 0..n-1 (llama.cpp reads separate streams in one
  pass only while their ids run on without a gap).

Every copy is of cells computed exactly as recomputing them would (the backend's invariant
configuration), so a reply is the same after a hit, a miss or a move.

A request that asks for it (`GenerateOptions.cache_reuse` N > 0, a backend that ShiftsCells)
also reuses what follows the shared prefix, as llama.cpp's server does with `--cache-reuse N`:
each chunk of at least N kept tokens that comes next in its prompt, the text kept before it left
out, is shifted into place (`reuse_plan`). Shifted cells are not what computing them in place
gives, nor is anything computed after them: the pool remembers where each slot's exact cells end
(`exact`), and a request that did not ask for reuse gets only exact cells. Its reply stays the
same whatever ran before; one that asked may differ with what the pool held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kinfer_rpc.types import ShiftsCells, common_prefix

if TYPE_CHECKING:
    from kinfer_rpc.engine.job import Job
    from kinfer_rpc.types import LoadedModel

MIN_SHARED = 8  # shorter shared prefixes are recomputed rather than copied across streams


class Slots:
    def __init__(self, model: LoadedModel, count: int, prefix: int):
        self.model = model
        self.prefix = prefix
        self.free: list[int] = list(range(count))
        self.kept: dict[int, list[int]] = {}  # free slot -> tokens its cells hold (prefix pool)
        self.clock = 0
        self.last_used: dict[int, int] = {}
        self.hits = 0
        self.cached_tokens = 0  # prompt tokens served from kept or copied cells, all time
        # slot -> how many of its first cells hold exactly what computing them in place gives
        # (absent: all); the rest were shifted, or computed after shifted cells
        self.exact: dict[int, int] = {}

    def kept_tokens(self) -> int:
        return sum(len(t) for t in self.kept.values())

    def _usable(self, slot: int, n: int, reuse: int) -> int:
        """Of `n` shared tokens in `slot`, those a request may use: all when it asked for reuse,
        else the exact ones."""
        return n if reuse else min(n, self.exact.get(slot, n))

    def take(self, job: Job, active: Sequence[Job]) -> None:
        """Give `job` a slot and set job.n_past to what its cells already hold."""
        prompt = job.prompt
        limit = len(prompt) - 1  # the last prompt token is always computed: it gives the logits
        # an image's placeholders say nothing of the image: cells are shared only before the first
        limit = min(limit, job.exact)
        if self.prefix < 0 or limit <= 0:
            if self.prefix < 0:
                self.free.sort()
                job.slot = self.free.pop(0)
            else:  # nothing to share (one token, or an image first): the free slot the pool misses least
                job.slot = self._coldest_free()
                self.free.remove(job.slot)
                self.kept.pop(job.slot, None)  # its cells go: the pool no longer holds them
            self.model.seq_remove(job.slot)
            self.exact.pop(job.slot, None)
            job.n_past = 0
            return
        reuse = job.options.cache_reuse if isinstance(self.model, ShiftsCells) and self.model.can_shift() else 0
        best_free, best_free_len, best_plan, best_score = None, 0, [], 0
        for slot in self.free:
            kept = self.kept.get(slot, ())
            n = self._usable(slot, min(common_prefix(kept, prompt), limit), reuse)
            plan = reuse_plan(kept, prompt, n, limit, reuse) if reuse else []
            score = plan[-1][1] + plan[-1][2] if plan else n
            if score > best_score:
                best_free, best_free_len, best_plan, best_score = slot, n, plan, score
        best_busy, best_busy_len = None, 0
        for other in active:
            n = min(
                common_prefix(other.prompt + other.generated[: max(0, other.n_past - len(other.prompt))], prompt),
                other.n_past,
                limit,
                other.exact,
            )
            n = self._usable(other.slot, n, reuse)
            if n > best_busy_len:
                best_busy, best_busy_len = other.slot, n
        if best_free is not None and best_score >= best_busy_len:
            slot, n = best_free, best_free_len
            self.free.remove(slot)
            self.kept.pop(slot, None)
            exact = self.exact.pop(slot, None)
            if best_plan:
                n = self._shift(slot, best_plan)
                exact = best_free_len if exact is None else min(exact, best_free_len)
            else:
                self.model.seq_remove(slot, n, -1)
            if exact is not None and exact < n:
                self.exact[slot] = exact
        else:
            slot = self._coldest_free()
            self.free.remove(slot)
            self.kept.pop(slot, None)
            self.exact.pop(slot, None)
            n = 0
            if best_busy is not None and best_busy_len >= MIN_SHARED:
                n = best_busy_len
                self.model.seq_copy(best_busy, slot)  # the whole stream; its tail is dropped next
                self.model.seq_remove(slot, n, -1)
                if (exact := self.exact.get(best_busy)) is not None and exact < n:
                    self.exact[slot] = exact
            else:
                self.model.seq_remove(slot)
        job.slot = slot
        job.n_past = n
        job.cached = n
        if n:
            self.hits += 1
            self.cached_tokens += n

    def _shift(self, slot: int, plan: list[tuple[int, int, int]]) -> int:
        """Move the planned chunks of `slot`'s cells into place (the cells between them go);
        returns how many of the prompt's tokens its cells then hold."""
        model = self.model
        assert isinstance(model, ShiftsCells), "a plan is made only for a model that shifts"
        for at_kept, at_prompt, length in plan:
            if at_prompt < at_kept:
                self.model.seq_remove(slot, at_prompt, at_kept)
                model.seq_shift(slot, at_kept, at_kept + length, at_prompt - at_kept)
        end = plan[-1][1] + plan[-1][2]
        self.model.seq_remove(slot, end, -1)
        return end

    def _coldest_free(self) -> int:
        empty = [s for s in self.free if s not in self.kept]
        if empty:
            return min(empty)
        return min(self.free, key=lambda s: self.last_used.get(s, -1))

    def give_back(self, job: Job, active: Sequence[Job]) -> list[Job]:
        """The job left: keep its cells for the pool, or clear them."""
        slot = job.slot
        self.clock += 1
        self.last_used[slot] = self.clock
        if self.prefix >= 0:
            history = job.prompt + job.generated
            self.kept[slot] = history[: min(job.n_past, job.exact)]
            if job.exact < job.n_past:  # cells past an image's placeholders are of no use to others
                self.model.seq_remove(slot, job.exact, -1)
            self.free.append(slot)
            self._trim()
            return []
        self.model.seq_remove(slot)
        self.exact.pop(slot, None)
        self.free.append(slot)
        return []

    def settled(self, active: Sequence[Job]) -> bool:
        """Whether compact() has nothing to move."""
        return self.prefix >= 0 or not self.free or not active or min(self.free) > max(j.slot for j in active)

    def compact(self, active: Sequence[Job]) -> None:
        """Per-slot streams: close one gap among busy ids (the highest busy slot moves into the
        lowest free one below it). Called after waiting requests took free slots, so a gap a
        new request fills costs nothing; at most one move a step, since llama.cpp copies the
        whole stream buffer for it."""
        if self.settled(active):
            return
        high = max(active, key=lambda j: j.slot)
        low = min(self.free)
        self.model.seq_copy(high.slot, low)
        self.model.seq_remove(high.slot)
        self.free.remove(low)
        self.free.append(high.slot)
        high.slot = low

    def _trim(self) -> None:
        while self.kept and self.kept_tokens() > self.prefix:
            oldest = min(self.kept, key=lambda s: self.last_used.get(s, -1))
            del self.kept[oldest]
            self.exact.pop(oldest, None)
            self.model.seq_remove(oldest)


def reuse_plan(
    kept: Sequence[int], prompt: Sequence[int], n: int, limit: int, min_chunk: int
) -> list[tuple[int, int, int]]:
    """llama.cpp's server's cache reuse: past the `n` shared tokens, the chunks of `kept` that come
    next in `prompt[:limit]`, each of at least `min_chunk` tokens, in order, as (where in `kept`,
    where in `prompt`, length). What `kept` has before a chunk is left out; the prompt gets no
    text in between (a slot's cells must run on without a gap), so each chunk moves towards the
    start, and the first comes right after the shared prefix."""
    plan: list[tuple[int, int, int]] = []
    if min_chunk <= 0:
        return plan
    at_kept = at_prompt = n
    while at_kept < len(kept) and at_prompt < limit:
        try:  # the next place where `kept` has the prompt's next token
            at_kept = kept.index(prompt[at_prompt], at_kept)
        except ValueError:
            break
        m = 0
        while at_kept + m < len(kept) and at_prompt + m < limit and kept[at_kept + m] == prompt[at_prompt + m]:
            m += 1
        if m >= min_chunk:
            plan.append((at_kept, at_prompt, m))
            at_kept += m
            at_prompt += m
        else:
            at_kept += 1
    return plan
