"""The `mlx` backend: MLX with mlx-lm's model code (pinned in pyproject.toml).

One concern a module, as mlx-lm keeps its models apart from their cache:
- vocab.py: the tokenizer (a GGUF's vocabulary and merges, or a Hugging Face tokenizer.json);
- loading.py: MLX folders, Ollama safetensors models and GGUF files read into mlx-lm's models,
  and the form their weights run in (quantized or dense);
- cells.py: the KV cells, and the caches mlx-lm's layers see over them in a pass;
- attention.py: the CUDA decode attention kernel; routing.py: its check at load, and the model's
  attention routed to it;
- model.py: the loaded model (the LoadedModel contract): decode passes, greedy rows sampled on
  the device;
- draft_count.py: the drafts per step a load takes by default, and how they were measured.

This module registers the backend (MlxBackend). It imports the others only where MLX, tokenizers
and mlx-lm are installed: without them the server runs with the other backends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import kinfer_rpc
from kinfer_rpc.types import Backend, LoadOptions, kinfer_home

log = logging.getLogger("kinfer_rpc.mlx")

# MLX compiles its CUDA kernels when a shape first runs (NVRTC: on an H200, minutes for a large
# mixture of experts' first batch of requests) and keeps them in MLX_PTX_CACHE_DIR, by default
# under the temporary directory, which a reboot or the system's cleaning empties. Kept with
# kinfer's files instead, unless the user named a place (MLX reads it at its first compile).
os.environ.setdefault("MLX_PTX_CACHE_DIR", str(kinfer_home() / "cache" / "mlx-ptx"))

mx: ModuleType | None  # mlx.core, None where MLX is not installed
_IMPORT_ERROR: str | None  # why the backend is not available
try:
    # mlx_lm.utils imports transformers (about a second): it is imported when a model loads,
    # so the server still answers `initialize` at once; here only whether it is installed.
    import importlib.util

    import mlx.core as mx
    import mlx.nn as nn  # noqa: F401 - imported here to see it is installed
    from tokenizers import Tokenizer  # noqa: F401 - imported here to see it is installed

    if importlib.util.find_spec("mlx_lm") is None:
        raise ImportError("mlx-lm is not installed")
except Exception as exc:  # noqa: BLE001 - no MLX here: the server runs with the other backends
    mx = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = None
    # The backend's own modules import MLX, tokenizers and mlx-lm, so only here; the public names
    # this module held before it was split stay reachable from it (benchmarks and tests use them).
    from kinfer_rpc.default_plugins.mlx.draft_count import DEFAULT_DRAFTS as DEFAULT_DRAFTS
    from kinfer_rpc.default_plugins.mlx.draft_count import pick_drafts as pick_drafts
    from kinfer_rpc.default_plugins.mlx.draft_count import step_cost_curve as step_cost_curve
    from kinfer_rpc.default_plugins.mlx.model import MlxModel as MlxModel
    from kinfer_rpc.default_plugins.mlx.vocab import Vocab as Vocab


class MlxBackend:
    """MLX with mlx-lm's models: reads MLX folders, Ollama safetensors models and GGUF."""

    name = "mlx"
    formats: tuple[str, ...] = ("mlx", "gguf")
    weights: tuple[str, ...] = ("quantized", "dense")

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> MlxModel:
        """A model that generates, or one that embeds where its folder declares a pooling
        (sentence-transformers' modules.json: mlx/embed.py)."""
        from kinfer_rpc.default_plugins.mlx.embed import MlxEmbedder, folder_pooling

        pooling = folder_pooling(path)
        if pooling is not None:
            return MlxEmbedder(path, options, progress, pooling)
        return MlxModel(path, options, progress)

    def features(self) -> dict[str, Any]:
        """It embeds with MLX folders that declare a pooling (mlx/embed.py)."""
        return {"embeddings": True}


@kinfer_rpc.hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    if _IMPORT_ERROR is not None:
        log.warning("the mlx backend is not available: %s", _IMPORT_ERROR)
        return
    register(MlxBackend())
