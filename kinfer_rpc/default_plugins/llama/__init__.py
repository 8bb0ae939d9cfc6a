"""The `llama` backend: llama.cpp through llama-cpp-python's low-level API.

One llama_context per load with `slots` sequences. Each `decode` fills one llama_batch from numpy
arrays we own (no per-token ctypes calls) and makes one llama_decode call; the logits of the rows
that asked for them come back in batch order from llama_get_logits.

With `LoadOptions.mtp` the model's multi-token-prediction (NextN) layers load too and a second
context runs them (mtp.Mtp): after every pass of the target it is caught up with the same tokens,
each paired with the target's hidden state of the position before, so its memory mirrors the
target's; the `mtp` draft policy drafts from it.

The package: `library` (the llama.cpp library, loaded once), `native` (how it gets into the
process safely), `model` (a generating model), `embed` (an embedding model or reranker),
`vocab`, `batch`, `mtp`, `buft` (where tensors go), `rpc` (RPC servers), `backend` (what the
plugin registers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import kinfer_rpc

if TYPE_CHECKING:
    from kinfer_rpc.types import Backend, DraftPolicy

# The modules that import numpy and llama_cpp load when first needed: importing `native` alone
# (patches/build_llama.sh runs it before anything else is in the process) must stay light.
_PUBLIC = {
    "Batch": "kinfer_rpc.default_plugins.llama.batch",
    "LlamaBackend": "kinfer_rpc.default_plugins.llama.backend",
    "LlamaModel": "kinfer_rpc.default_plugins.llama.model",
    "MtpPolicy": "kinfer_rpc.default_plugins.llama.backend",
}
__all__ = [*_PUBLIC, "register_backends", "register_draft_policies"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@kinfer_rpc.hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    from kinfer_rpc.default_plugins.llama.backend import LlamaBackend

    register(LlamaBackend())


@kinfer_rpc.hookimpl
def register_draft_policies(register: Callable[[DraftPolicy], None]) -> None:
    from kinfer_rpc.default_plugins.llama.backend import MtpPolicy

    register(MtpPolicy())
