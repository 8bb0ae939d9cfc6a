"""A runtime shared by many clients (kinfer_rpc.host.runtime): idle models evicted, least recently
used first, when a load does not fit; a pinned model never. The placement here is a test's own
plugin placement (a real one needs a machine whose memory is full), the models the embedded one
under two names, loaded for real."""

from __future__ import annotations

import anyio
import pytest

from kinfer_rpc import errors
from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.host.runtime import Runtime
from kinfer_rpc.host.store import DEFAULT_MODEL, embedded_default_path
from kinfer_rpc.protocol.options import load_request
from kinfer_rpc.types import PlacementPlan

pytestmark = pytest.mark.model


class OneAtATime:
    """A placement of a machine with room for one model: the load does not fit while another is loaded."""

    name = "one-at-a-time"

    def __init__(self) -> None:
        self.runtime: Runtime | None = None

    def plan(self, model, machine, options):
        assert self.runtime is not None
        if self.runtime.loaded:  # (the load being placed is not in it yet)
            raise ValueError(f"{next(iter(self.runtime.loaded))} takes the memory")
        return PlacementPlan(gpu_layers=0, reason="room for one")


def _runtime() -> tuple[Runtime, OneAtATime]:
    plugins = load_plugins()
    placement = OneAtATime()
    plugins.placements[placement.name] = placement
    runtime = Runtime(plugins)
    placement.runtime = runtime
    return runtime, placement


def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_model():
    async def main():
        runtime, _ = _runtime()
        path = str(embedded_default_path())
        try:
            await runtime.load(DEFAULT_MODEL)  # the placement's own "auto": fits
            tight = load_request({"placement": "one-at-a-time", "contextLength": 256})
            evicted: list[str] = []
            entry = await runtime.load(path, request=tight, evicted=evicted)
            assert evicted == [DEFAULT_MODEL] and list(runtime.loaded) == [entry.name]
            # pinned, the loaded one stays, and the load that needs its room fails as before
            await runtime.load(path, pin=True)
            with pytest.raises(errors.KinferError) as e:
                await runtime.load(DEFAULT_MODEL, request=load_request({"placement": "one-at-a-time"}))
            assert e.value.code == errors.LOAD_FAILED and "does not fit" in e.value.message
            assert list(runtime.loaded) == [path]
        finally:
            await anyio.to_thread.run_sync(runtime.close)

    anyio.run(main)


def test_a_model_running_a_request_is_not_evicted():
    async def main():
        runtime, _ = _runtime()
        try:
            entry = await runtime.load(DEFAULT_MODEL)
            entry.running = 1  # a request in flight on it
            with pytest.raises(errors.KinferError, match="does not fit"):
                await runtime.load(str(embedded_default_path()), request=load_request({"placement": "one-at-a-time"}))
            assert DEFAULT_MODEL in runtime.loaded
            entry.running = 0
        finally:
            await anyio.to_thread.run_sync(runtime.close)

    anyio.run(main)
