"""Decode attention on CUDA, routed: the mlx backend checks attention.py's kernel at load and
wraps the model's attention so that its compiled decode passes (a _Traced cache with the kernel on)
call the kernel.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx

from kinfer_rpc.default_plugins.mlx.cells import _Traced
from kinfer_rpc.default_plugins.mlx.loading import _flat

log = logging.getLogger("kinfer_rpc.mlx")


def _attention_kernel(model: Any, config: dict[str, Any]) -> bool:  # model: an mlx-lm model
    """Route the decode passes' attention of `model` to kinfer_mlx_attention's kernel (CUDA only;
    KINFER_MLX_ATTENTION=0 keeps MLX's masked attention, for comparison), once the kernel has
    passed its check against MLX's operations here. False when the kernel cannot run here, fails
    the check, or the model's attention cannot be routed (_route_attention)."""
    from kinfer_rpc.default_plugins.mlx import attention as mlx_attention

    if os.environ.get("KINFER_MLX_ATTENTION", "1") == "0" or not mlx_attention.available():
        return False
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // max(heads, 1)))
    if not heads or heads % kv or head_dim % 32:
        return False
    try:  # the kernel against plain MLX operations once per load (it is MLX's JIT that builds it)
        dtype = next(
            (v.dtype for _, v in _flat(model.parameters()) if v.dtype in (mx.float16, mx.bfloat16, mx.float32)),
            mx.float16,
        )
        diff = mlx_attention.self_check(dtype, head_dim, heads // kv)
    except Exception as exc:  # noqa: BLE001 - a CUDA build without NVRTC headers, say: MLX's attention
        log.warning("mlx: the decode attention kernel did not run (%s); using MLX's attention", exc)
        return False
    if not diff < (0.05 if dtype == mx.bfloat16 else 0.02):
        log.warning("mlx: the decode attention kernel differs from MLX's by %s; using MLX's attention", diff)
        return False
    return _route_attention(model)


def _route_attention(model: Any) -> bool:
    """mlx-lm's attention layers call their module's `scaled_dot_product_attention` (mlx_lm.models.
    base's); that name is wrapped in the module of the model's attention layer, so that a layer
    whose cache is a _Traced with the kernel on calls the kernel (with the layer's new cells, which
    it writes into the buffers), and every other call (mlx-lm's own caches, prompt passes) goes on
    to the original. False when the attention layer is not found, does not call such a function,
    or uses attention sinks."""
    import sys

    from kinfer_rpc.default_plugins.mlx import attention as mlx_attention

    layers = getattr(model, "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    if attn is None or hasattr(attn, "sinks"):
        return False
    module: Any = sys.modules.get(type(attn).__module__)  # Any: a name is assigned to it below
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    original = getattr(original, "kinfer_original", original)

    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if isinstance(cache, _Traced) and cache.kernel:
            if sinks is not None:
                raise NotImplementedError("attention sinks are not supported by the decode attention kernel")
            i = cache.layer
            cache_keys, cache_values, counter = cache.keys[i], cache.values[i], cache.counter
            assert cache_keys is not None and cache_values is not None and counter is not None  # set with the kernel
            return mlx_attention.attention(
                queries,
                keys,
                values,
                cache_keys,
                cache_values,
                cache.slots,
                cache.cols,
                scale,
                counter,
                splits=cache.kernel,
            )
        out: mx.array = original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return out

    scaled_dot_product_attention.__dict__["kinfer_original"] = original  # a function attribute
    module.scaled_dot_product_attention = scaled_dot_product_attention
    return True
