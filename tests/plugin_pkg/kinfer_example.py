"""An example kinfer-rpc plugin: one draft policy, one placement and one backend.

Installed like any third-party plugin (see pyproject.toml next to this file); docs/plugins.md walks
through it. Each kind is small but real: the policy and the placement do what they say, and the
backend reads a format no real model has, so it can never be picked for a GGUF or MLX model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import kinfer_rpc
from kinfer_rpc.types import LoadedModel, LoadOptions, MachineInfo, ModelFacts, PlacementPlan


class RepeatDraft:
    """Drafts the last token again, k times: right whenever the reply is repeating itself.

    Reads nothing but `history`, so a request's drafts never depend on its neighbours.
    """

    name = "example-repeat"

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if not history or k <= 0:
            return []
        return [history[-1]] * k


class CpuOnly:
    """Keeps every layer in host memory, and says so; refuses a model the host cannot hold."""

    name = "example-cpu"

    def plan(self, model: ModelFacts, machine: MachineInfo, options: LoadOptions) -> PlacementPlan:
        if machine.host_free_bytes and model.size_bytes > machine.host_free_bytes:
            # The contract: a ValueError whose message says what would fit.
            raise ValueError(
                f"{os.path.basename(model.path)} needs {model.size_bytes} bytes of host memory and "
                f"{machine.host_free_bytes} are free: pick a model under {machine.host_free_bytes} bytes"
            )
        layers = f"all {model.layers} layers" if model.layers else "every layer"
        return PlacementPlan(gpu_layers=0, reason=f"example-cpu keeps {layers} in host memory")


class EchoBackend:
    """A backend for the made-up format "echo": registered and listed, but it loads nothing."""

    name = "example-echo"
    formats = ("echo",)

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> LoadedModel:
        raise NotImplementedError(
            f"example-echo cannot load {path!r}: it is the worked example of docs/plugins.md and "
            "loads no models; use a real backend such as llama"
        )


@kinfer_rpc.hookimpl
def register_draft_policies(register):
    register(RepeatDraft())


@kinfer_rpc.hookimpl
def register_placements(register):
    register(CpuOnly())


@kinfer_rpc.hookimpl
def register_backends(register):
    register(EchoBackend())
