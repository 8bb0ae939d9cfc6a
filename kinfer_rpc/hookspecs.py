"""The hooks a kinfer-rpc plugin implements.

Each hook is a registrar: the host passes a `register` callback and the plugin calls it once per
thing it provides. A plugin is one module with an entry point in the `kinfer_rpc` group:

    [project.entry-points.kinfer_rpc]
    myplugin = "my_module"

and implements any of the hooks below with `@kinfer_rpc.hookimpl`. The types it registers are
described in kinfer_rpc.types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kinfer_rpc.types import Backend, DraftPolicy, Placement

hookspec = pluggy.HookspecMarker("kinfer_rpc")
hookimpl = pluggy.HookimplMarker("kinfer_rpc")


@hookspec
def register_backends(register: Callable[[Backend], None]) -> None:
    """Register backends: call `register(backend)` for each.

    A backend (kinfer_rpc.types.Backend) has a unique `name`, the model `formats` it reads, and
    `load(path, options, progress)` returning a LoadedModel: tokenize/detokenize, chat template,
    ONE decode pass over many (sequence, tokens) chunks returning the logits rows asked for,
    copy/remove of sequences, memory figures. The engine calls every method of a loaded model
    from its one worker thread. Called once at start-up.
    """


@hookspec
def register_draft_policies(register: Callable[[DraftPolicy], None]) -> None:
    """Register draft policies for speculative decoding: call `register(policy)` for each.

    A policy (kinfer_rpc.types.DraftPolicy) has a unique `name` and either `propose(history,
    k)`, returning at most k draft tokens from one request's own tokens, or `session(target,
    backend, options)` for state per load (checked at registration: exactly one). The engine verifies drafts
    against the target model in the same decode pass as every other sequence, so a policy can
    change speed but never a reply. Called once at start-up.
    """


@hookspec
def register_placements(register: Callable[[Placement], None]) -> None:
    """Register placements: call `register(placement)` for each.

    A placement (kinfer_rpc.types.Placement) has a unique `name` and
    `plan(model, machine, options)` returning a PlacementPlan: GPU layers, tensor patterns kept
    in host memory, the prompt pass size, with several GPUs (`machine.gpus`) how the layers are
    split over them, and a reason, or raising ValueError that says what would fit. Called once
    at start-up.
    """
