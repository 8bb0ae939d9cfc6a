"""What the backend's CUDA kernels (attention.py, matmul.py) share: whether this MLX can run
them, and making one with `mx.fast.cuda_kernel`.

MLX caches a compiled kernel by its name (with the template values), also on disk across
processes: the source's hash in the name keeps a changed source from running an older build.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import cast

import mlx.core as mx


def available() -> bool:
    """Whether this MLX can run the kernels: a CUDA build, on the GPU."""
    cuda = getattr(mx, "cuda", None)
    return (
        hasattr(mx.fast, "cuda_kernel") and cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
    )


def make(stem: str, source: str, inputs: list[str], outputs: list[str]) -> Callable[..., list[mx.array]]:
    """The kernel of `source` (a body, as `mx.fast.cuda_kernel` takes it), named `stem` and the
    source's hash. Calling it returns its outputs, in the order of `outputs`."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    kernel = mx.fast.cuda_kernel(name=f"{stem}_{digest}", input_names=inputs, output_names=outputs, source=source)
    return cast("Callable[..., list[mx.array]]", kernel)  # MLX's stubs type it as a plain object
