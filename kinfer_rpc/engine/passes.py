"""A decode pass as a value: its rows (chunks), the jobs that own them, the wait for its logits,
what kind of rows it has (Shape) and where it is (PassState).

The engine holds at most two passes in flight: the one a step takes (planned by that step, or
started ahead by the step before, AHEAD), and one chained to it on the device (CHAINED), which
becomes the next AHEAD pass or is dropped. A pass is TAKEN once its logits are read, DROPPED
when it is waited for and its rows thrown away.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import attrs
import numpy as np

from kinfer_rpc.engine.job import Job
from kinfer_rpc.types import SeqChunk

log = logging.getLogger(__name__)


class PassState(enum.Enum):
    """PLANNED: launched by the step that planned it. AHEAD: launched before the last pass's
    tokens were taken, the next step takes it instead of planning. CHAINED: launched on the
    device right behind the pass in flight (decode_chained), fed with that pass's argmax.
    TAKEN: its logits read. DROPPED: waited for, its rows thrown away."""

    PLANNED = "planned"
    AHEAD = "ahead"
    CHAINED = "chained"
    TAKEN = "taken"
    DROPPED = "dropped"


_MOVES = {
    PassState.PLANNED: {PassState.TAKEN, PassState.DROPPED},
    PassState.AHEAD: {PassState.TAKEN, PassState.DROPPED},
    PassState.CHAINED: {PassState.AHEAD, PassState.DROPPED},
    PassState.TAKEN: set(),
    PassState.DROPPED: set(),
}


class Shape(enum.Enum):
    """What a pass's rows allow of the next pass. MIXED: it is planned once this one's tokens
    are taken. STEADY: every job one greedy token, so the next pass may start before this one's
    bookkeeping. CHAINABLE: steady and no row held to a grammar, so the next pass may also be
    chained to this one on the device (it is fed the device's argmax)."""

    MIXED = "mixed"
    STEADY = "steady"
    CHAINABLE = "chainable"

    @classmethod
    def of(cls, ahead: bool, drafting: bool, decoding: list[Job], active: list[Job]) -> Shape:
        """The shape of a pass whose decoding rows are `decoding`'s, of the `active` jobs.
        `ahead`: whether passes may start ahead at all (Engine.start_ahead)."""
        if not ahead or drafting or len(decoding) != len(active) or not all(j.greedy for j in decoding):
            return cls.MIXED
        return cls.CHAINABLE if all(j.plain for j in decoding) else cls.STEADY

    @property
    def steady(self) -> bool:
        return self is not Shape.MIXED


@attrs.define(eq=False)
class Pass:
    """One decode pass in flight. `ended`: jobs that ended while this pass holds their rows;
    their slots go back once it is done."""

    chunks: list[SeqChunk]
    owners: list[Job]
    wait: Callable[[], np.ndarray]
    state: PassState
    shape: Shape = Shape.MIXED
    ended: list[Job] = attrs.field(factory=list)

    def move(self, to: PassState) -> None:
        """The one way a pass changes state; anything but PassState's story is a bug."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"a pass cannot move from {self.state.value} to {to.value}")
        self.state = to

    def take(self) -> np.ndarray:
        """Wait for the pass and return its logits (or the device's tokens' rows)."""
        logits = self.wait()
        self.move(PassState.TAKEN)
        return logits

    def drop(self) -> None:
        """Wait for the pass and throw its rows away; a failure is logged, not raised (the
        pass is being dropped because something else ended or failed)."""
        was = self.state
        self.move(PassState.DROPPED)
        try:
            self.wait()
        except Exception:
            log.exception("a pass %s failed", was.value)

    def holds(self, job: Job) -> bool:
        return job in self.owners
