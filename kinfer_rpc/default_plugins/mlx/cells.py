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

    def __init__(self, slots: int, layers: int) -> None:
        self.slots = slots
        self.keys: list[mx.array | None] = [None] * layers  # None: the layer has no buffer yet
        self.values: list[mx.array | None] = [None] * layers
        self.cap = 0
        self.want = 0  # cells the pass being built needs
        self.length = [0] * slots  # tokens each slot holds (positions 0..length-1)

    def reserve(self, cells: int) -> None:
        self.want = max(self.want, -(-cells // STEP) * STEP)

    def _ensure(self, layer: int, k: mx.array, v: mx.array) -> None:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None:
            B, H, _, D = k.shape
            shape = (self.slots, H, self.want, D)
            keys = self.keys[layer] = mx.zeros(shape, k.dtype)
            self.values[layer] = mx.zeros((*shape[:3], v.shape[-1]), v.dtype)
        elif keys.shape[2] < self.want:
            assert values is not None  # made with the keys
            grow = self.want - keys.shape[2]
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            keys = self.keys[layer] = mx.pad(keys, pad)
            self.values[layer] = mx.pad(values, pad)
        self.cap = max(self.cap, keys.shape[2])

    def grow(self) -> bool:
        """Every layer's buffers padded to `want` cells now; False when a layer has none yet."""
        if any(k is None for k in self.keys):
            return False
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            assert keys is not None and values is not None  # made together
            if keys.shape[2] < self.want:
                pad = [(0, 0), (0, 0), (0, self.want - keys.shape[2]), (0, 0)]
                self.keys[i], self.values[i] = mx.pad(keys, pad), mx.pad(values, pad)
                self.cap = max(self.cap, self.want)
        return True

    def arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class _Rows:
    """The cache one layer sees in a batched pass: row b holds L tokens of slot slots[b] at
    positions pos[b].. ; it attends to its own slot's cells up to each token's position."""

    def __init__(
        self,
        cells: _Cells,
        layer: int,
        slots: mx.array,
        cols: mx.array,
        offset: mx.array,
        mask: mx.array,
        span: int,
        first: int | None,
    ) -> None:
        self.cells, self.layer = cells, layer
        self.slots, self.cols, self.offset, self.mask, self.span = slots, cols, offset, mask, span
        self.first = first

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        c, i = self.cells, self.layer
        c._ensure(i, k, v)
        K, V = c.keys[i], c.values[i]
        assert K is not None and V is not None  # _ensure made them
        K[self.slots[:, None], :, self.cols] = k.transpose(0, 2, 1, 3)
        V[self.slots[:, None], :, self.cols] = v.transpose(0, 2, 1, 3)
        if self.first is not None:  # rows are the slots first.. in order: a view, not a gathered copy
            rows = slice(self.first, self.first + k.shape[0])
            return K[rows, :, : self.span], V[rows, :, : self.span]
        return K[self.slots, :, : self.span], V[self.slots, :, : self.span]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask


class _Traced:
    """The cache one layer sees in a compiled decode pass: the same reads and writes as _Rows, on
    the layer's buffers passed in (and returned) as arrays, positions and mask built on the device
    from `cols`, so that a step hands the graph only small index arrays."""

    def __init__(
        self,
        keys: list[mx.array | None],
        values: list[mx.array | None],
        layer: int,
        slots: mx.array,
        cols: mx.array,
        pos: mx.array,
        mask: mx.array | None,
        span: int,
        first: mx.array | None,
        kernel: int = 0,
        counter: mx.array | None = None,
    ) -> None:
        self.keys, self.values, self.layer = keys, values, layer
        self.slots, self.cols, self.offset, self.mask, self.span, self.first = slots, cols, pos, mask, span, first
        # On CUDA (kernel: thread blocks a row, see MlxModel.kernel): the attention is
        # kinfer_mlx_attention's, which also writes the pass's cells into the buffers in place
        # (counter: its scratch). Otherwise every write on CUDA would be a scatter (MLX 0.32
        # CUDA's slice_update at a device-side start copies the whole buffer: 17 ms a pass for
        # 64 buffers of 128 slots, measured).
        self.kernel, self.counter = kernel, counter

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self.kernel:  # the attention kernel writes and reads them (see scaled_dot_product_attention)
            return k, v
        i, B = self.layer, k.shape[0]
        K, V = self.keys[i], self.values[i]
        assert K is not None and V is not None  # a compiled pass runs over buffers that exist
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

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array | None:
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not supported by the mlx backend yet")
        return self.mask
