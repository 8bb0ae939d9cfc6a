"""Embedding models on the mlx backend: an MLX folder laid out as a sentence-transformers model
(its `modules.json` names a Pooling module whose config says mean, cls or last pooling) on an
architecture mlx-lm has (a decoder: Qwen3-Embedding and the like). mlx-lm has no encoders (BERT and
its kin): such a folder is refused with -31006, naming the llama backend, which runs their GGUF.

Each input is one forward pass of mlx-lm's model body (the final norm's output, without the head),
pooled here: the pass's shape depends on that input alone, so its vector does too. On the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.mlx.model import MlxModel
from kinfer_rpc.types import LoadOptions, SeqChunk

# sentence-transformers' Pooling config keys, as kinfer's poolings
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def folder_pooling(path: str) -> str | None:
    """The pooling a sentence-transformers folder declares, None for a folder without one; -31006
    for a pooling kinfer does not run (max, weighted mean)."""
    folder = Path(path)
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    for module in modules if isinstance(modules, list) else []:
        if not str(module.get("type", "")).endswith("Pooling"):
            continue
        try:
            config = json.loads((folder / str(module.get("path", "")) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        modes = [name for key, name in _MODES.items() if config.get(key)]
        if len(modes) == 1 and not any(
            v for k, v in config.items() if k.startswith("pooling_mode") and k not in _MODES
        ):
            return modes[0]
        raise errors.KinferError(
            errors.NOT_SUPPORTED,
            f"{folder.name} pools its tokens in a way kinfer does not run ({config}); mean, cls or last pooling only",
        )
    return None


class MlxEmbedder(MlxModel):
    """An MLX model loaded to embed (Embeds, Reproducible): mlx-lm's model body, pooled."""

    dimensions: tuple[int, ...] = ()

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None], pooling: str) -> None:
        # One sequence, on the CPU: no slots, and no kernels routed for a GPU's decode passes.
        try:
            super().__init__(path, attrs.evolve(options, slots=1, gpu_layers=0, drafts=0), progress)
        except ValueError as exc:
            if "not supported" not in str(exc):
                raise
            raise errors.KinferError(
                errors.NOT_SUPPORTED,
                f"the mlx backend cannot embed with {Path(path).name}: {exc} (mlx-lm has decoders, not encoders such "
                "as BERT); convert it to GGUF with llama.cpp's convert_hf_to_gguf.py and run it on the llama backend",
            ) from None
        if not self.split_head:
            raise errors.KinferError(
                errors.NOT_SUPPORTED,
                f"the mlx backend cannot take the hidden states of a {self.config.get('model_type')} model to pool "
                "them; run its GGUF on the llama backend",
            )
        self.pooling = pooling

    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        rows = []
        with mx.stream(self.device):
            for tokens in token_lists:
                h = self.model.model(mx.array([list(tokens)]))[0]  # (tokens, hidden): the final norm's output
                pooled = h.mean(axis=0) if self.pooling == "mean" else h[0] if self.pooling == "cls" else h[-1]
                rows.append(np.array(pooled.astype(mx.float32)))
        return np.stack(rows)

    def reproducible(self) -> tuple[bool, str]:
        return True, "each input is embedded in an MLX pass of its own on the CPU, so its vector depends on it alone"

    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]:
        raise RuntimeError(f"{self.info.name} is an embedding model (pooling {self.pooling}): it does not generate")
