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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kinfer_rpc.types import common_prefix

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

    def kept_tokens(self) -> int:
        return sum(len(t) for t in self.kept.values())

    def take(self, job: Job, active: Sequence[Job]) -> None:
        """Give `job` a slot and set job.n_past to what its cells already hold."""
        prompt = job.prompt
        limit = len(prompt) - 1  # the last prompt token is always computed: it gives the logits
        if self.prefix < 0 or limit <= 0:
            self.free.sort()
            job.slot = self.free.pop(0)
            self.model.seq_remove(job.slot)
            job.n_past = 0
            return
        best_free, best_free_len = None, 0
        for slot in self.free:
            n = min(common_prefix(self.kept.get(slot, ()), prompt), limit)
            if n > best_free_len:
                best_free, best_free_len = slot, n
        best_busy, best_busy_len = None, 0
        for other in active:
            n = min(
                common_prefix(other.prompt + other.generated[: max(0, other.n_past - len(other.prompt))], prompt),
                other.n_past,
                limit,
            )
            if n > best_busy_len:
                best_busy, best_busy_len = other.slot, n
        if best_free is not None and best_free_len >= best_busy_len:
            slot, n = best_free, best_free_len
            self.free.remove(slot)
            self.kept.pop(slot, None)
            self.model.seq_remove(slot, n, -1)
        else:
            slot = self._coldest_free()
            self.free.remove(slot)
            self.kept.pop(slot, None)
            n = 0
            if best_busy is not None and best_busy_len >= MIN_SHARED:
                n = best_busy_len
                self.model.seq_copy(best_busy, slot)  # the whole stream; its tail is dropped next
                self.model.seq_remove(slot, n, -1)
            else:
                self.model.seq_remove(slot)
        job.slot = slot
        job.n_past = n
        job.cached = n
        if n:
            self.hits += 1
            self.cached_tokens += n

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
            self.kept[slot] = history[: job.n_past]
            self.free.append(slot)
            self._trim()
            return []
        self.model.seq_remove(slot)
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
            self.model.seq_remove(oldest)
