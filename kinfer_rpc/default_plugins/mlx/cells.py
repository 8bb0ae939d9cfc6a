"""The mlx backend's KV cells, and the caches mlx-lm's layers see over them in a pass.

KV cells live in one buffer per layer, (slots, kv heads, cells, head dim), each slot's tokens at
their own positions (_Cells). A batched pass hands each layer a _Rows (eager: prompt passes) or a
_Traced (the compiled decode pass) in place of mlx-lm's own KV caches.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256  # KV buffers grow by this many cells, and a batched pass reads keys in these blocks


class _Cells:
    """Every slot's KV cells: per layer one key and one value buffer (slots, heads, cells, dim)."""

    def __init__(self, slots: int, layers: int):
        self.slots = slots
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.cap = 0
        self.want = 0  # cells the pass being built needs
        self.length = [0] * slots  # tokens each slot holds (positions 0..length-1)

    def reserve(self, cells: int) -> None:
        self.want = max(self.want, -(-cells // STEP) * STEP)

    def _ensure(self, layer: int, k, v) -> None:
        if self.keys[layer] is None:
            B, H, _, D = k.shape
            shape = (self.slots, H, self.want, D)
            self.keys[layer] = mx.zeros(shape, k.dtype)
            self.values[layer] = mx.zeros((*shape[:3], v.shape[-1]), v.dtype)
        elif self.keys[layer].shape[2] < self.want:
            grow = self.want - self.keys[layer].shape[2]
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys[layer] = mx.pad(self.keys[layer], pad)
            self.values[layer] = mx.pad(self.values[layer], pad)
        self.cap = max(self.cap, self.keys[layer].shape[2])

    def arrays(self) -> list:
        return [a for a in self.keys + self.values if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class _Rows:
    """The cache one layer sees in a batched pass: row b holds L tokens of slot slots[b] at
    positions pos[b].. ; it attends to its own slot's cells up to each token's position."""

    def __init__(self, cells: _Cells, layer: int, slots, cols, offset, mask, span: int, first: int | None):
        self.cells, self.layer = cells, layer
        self.slots, self.cols, self.offset, self.mask, self.span = slots, cols, offset, mask, span
        self.first = first

    def update_and_fetch(self, k, v):
        c, i = self.cells, self.layer
        c._ensure(i, k, v)
        c.keys[i][self.slots[:, None], :, self.cols] = k.transpose(0, 2, 1, 3)
        c.values[i][self.slots[:, None], :, self.cols] = v.transpose(0, 2, 1, 3)
        if self.first is not None:  # rows are the slots first.. in order: a view, not a gathered copy
            rows = slice(self.first, self.first + k.shape[0])
            return c.keys[i][rows, :, : self.span], c.values[i][rows, :, : self.span]
        return c.keys[i][self.slots, :, : self.span], c.values[i][self.slots, :, : self.span]

    def make_mask(self, N, return_array=False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask


class _Traced:
    """The cache one layer sees in a compiled decode pass: the same reads and writes as _Rows, on
    the layer's buffers passed in (and returned) as arrays, positions and mask built on the device
    from `cols`, so that a step hands the graph only small index arrays."""

    def __init__(
        self,
        keys: list,
        values: list,
        layer: int,
        slots,
        cols,
        pos,
        mask,
        span: int,
        first,
        kernel: int = 0,
        counter=None,
    ):
        self.keys, self.values, self.layer = keys, values, layer
        self.slots, self.cols, self.offset, self.mask, self.span, self.first = slots, cols, pos, mask, span, first
        # On CUDA (kernel: thread blocks a row, see MlxModel.kernel): the attention is
        # kinfer_mlx_attention's, which also writes the pass's cells into the buffers in place
        # (counter: its scratch). Otherwise every write on CUDA would be a scatter (MLX 0.32
        # CUDA's slice_update at a device-side start copies the whole buffer: 17 ms a pass for
        # 64 buffers of 128 slots, measured).
        self.kernel, self.counter = kernel, counter

    def update_and_fetch(self, k, v):
        if self.kernel:  # the attention kernel writes and reads them (see scaled_dot_product_attention)
            return k, v
        i, B = self.layer, k.shape[0]
        K, V = self.keys[i], self.values[i]
        if B == 1:  # one sequence: its L cells are one block at (slot, 0, pos, 0)
            at = mx.concatenate([self.slots, mx.zeros((1,), mx.int32), self.offset, mx.zeros((1,), mx.int32)])
            K = mx.slice_update(K, k, at, (0, 1, 2, 3))
            V = mx.slice_update(V, v, at, (0, 1, 2, 3))
        else:
            K[self.slots[:, None], :, self.cols] = k.transpose(0, 2, 1, 3)
            V[self.slots[:, None], :, self.cols] = v.transpose(0, 2, 1, 3)
        self.keys[i], self.values[i] = K, V
        if self.first is not None:  # rows are consecutive slots: a slice at a device-side start
            return (
                mx.slice(K, self.first, (0,), (B, K.shape[1], self.span, K.shape[3])),
                mx.slice(V, self.first, (0,), (B, V.shape[1], self.span, V.shape[3])),
            )
        return K[self.slots, :, : self.span], V[self.slots, :, : self.span]

    def make_mask(self, N, return_array=False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask
