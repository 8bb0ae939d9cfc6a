"""The mlx backend's loaded model (the LoadedModel contract): decode passes over the KV cells.

A pass groups the step's chunks: every decode chunk (one token, or a token and its drafts) goes
into ONE batched forward, a row per sequence with its own positions and mask; each prompt chunk
is its own forward over its slot. Everything of a step is one graph, evaluated once with
mx.async_eval; the engine's wait is the only host read. The decode forward is mx.compile'd per
shape (_step_fn); greedy rows end in an argmax on the device (device_greedy), and a pass of only
greedy one-token rows can have the next pass chained to it, fed with its own argmax on the device
(decode_chained, when the engine asks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import numpy as np

from kinfer_rpc.default_plugins.mlx import matmul as mlx_matmul
from kinfer_rpc.default_plugins.mlx.cells import STEP, _Cells, _Rows, _Traced
from kinfer_rpc.default_plugins.mlx.draft_count import DEFAULT_DRAFTS
from kinfer_rpc.default_plugins.mlx.loading import (
    _flat,
    _float_type,
    _is_gguf,
    _load_folder,
    _load_gguf,
    _load_ollama,
    _quantized,
    _weights_form,
)
from kinfer_rpc.default_plugins.mlx.routing import _attention_kernel
from kinfer_rpc.types import LoadOptions, ModelInfo, SeqChunk

if TYPE_CHECKING:
    # Every layer's key (or value) buffer, None until the layer's first pass (_Cells).
    _Buffers = list[mx.array | None]
    # A decode pass (_step_fn): tokens, slots, cols, pos, rows, keys, values -> logits, keys, values.
    _Step = Callable[
        [mx.array, mx.array, mx.array, mx.array, mx.array, _Buffers, _Buffers], tuple[mx.array, _Buffers, _Buffers]
    ]
    # The last pass, when decode_chained can extend it: (seq, position) of each row, its argmax.
    _Last = tuple[list[tuple[int, int]], mx.array]

log = logging.getLogger("kinfer_rpc.mlx")

# Architectures whose Model.__call__ is exactly `head(model.model(x))`: the head then runs only on
# the rows that asked for logits (not on every prompt token), and on CUDA their decode attention
# is kinfer's kernel (routing.py).
_SPLIT_HEAD = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite", "qwen3_moe", "qwen2_moe", "mixtral"}
# Of those, the mixtures of experts: their experts' gathered matrix products stay MLX's, so their
# decode passes cannot be row-invariant and do not take kinfer's row-invariant matmul.
_EXPERTS = {"qwen3_moe", "qwen2_moe", "mixtral"}


class MlxModel:
    """A model loaded into MLX (the LoadedModel contract)."""

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> None:
        if options.host_tensors:
            raise NotImplementedError("keeping tensors in host memory is not supported by the mlx backend")
        if options.mtp:  # mlx-lm's model code drops the MTP weights as it loads them (each model's sanitize)
            raise NotImplementedError(
                "draftPolicy mtp is not supported by the mlx backend: mlx-lm's models load without their"
                " multi-token-prediction layers; use the llama backend, or draftPolicy ngram or draft-model"
            )
        if options.kv_type not in (None, "f16"):
            raise ValueError(
                f"the mlx backend keeps KV cells in the model's float type; kvType {options.kv_type!r} is not supported"
            )
        on_gpu = options.gpu_layers != 0 and mx.default_device() == mx.gpu
        self.device = mx.gpu if on_gpu else mx.cpu
        progress(0.0)
        p = Path(path)
        with mx.stream(self.device):
            if p.is_dir():
                self.model, self.config, self.vocab = _load_folder(path)
            elif p.is_file() and _is_gguf(p):
                self.model, self.config, self.vocab, _ = _load_gguf(path)
            elif p.is_file():
                self.model, self.config, self.vocab = _load_ollama(path)
            else:
                raise FileNotFoundError(f"no model at {path}")
            if not on_gpu or p.is_file() and _is_gguf(p):
                _float_type(self.model, mx.float16 if on_gpu else mx.float32)
            # kinfer's row-invariant kernels (attention.py, matmul.py) in the decode passes: on a
            # GPU, for the families whose attention is routed, unless the load asks for speed
            # (reproducible false) or KINFER_MLX_MATMUL=0 (checked at load: see below)
            rows = (
                on_gpu
                and self.config.get("model_type") in _SPLIT_HEAD - _EXPERTS
                and options.reproducible is not False
                and os.environ.get("KINFER_MLX_MATMUL", "1") != "0"
                and mlx_matmul.available()
            )
            self.weights, self.weights_reason = _weights_form(self.model, options.weights, on_gpu, rows)
            if self.weights == "dense" and _quantized(self.model):
                from mlx_lm.utils import dequantize_model

                self.model = dequantize_model(self.model)
                _float_type(self.model, mx.float16 if on_gpu else mx.float32)
                mx.clear_cache()
        progress(0.9)
        self.layers = len(self.model.layers)
        self.split_head = self.config.get("model_type") in _SPLIT_HEAD and hasattr(self.model, "model")
        self.cells = _Cells(options.slots, self.layers)
        self._compiled: dict[tuple[bool, int], _Step] = {}  # (slots consecutive, span) -> the compiled decode step
        self._greedy: set[int] = set()  # slots whose rows are sampled (argmax) in the pass
        # the token ids (device) and greedy rows of the pass whose wait was called last
        self._sampled: tuple[mx.array | None, list[bool]] = (None, [])
        self._last: _Last | None = None  # the last pass launched, when it can be chained to
        self.context = options.context_length
        drafts = (
            options.drafts if options.drafts is not None else DEFAULT_DRAFTS["gpu" if on_gpu else "cpu", self.weights]
        )
        self.drafts = drafts
        # With the attention kernel: the thread blocks a row (chunks of cells), enough for the
        # context length, and the kernel's counter; 0: MLX's attention.
        self.kernel = 0
        self.counter: mx.array | None = None
        if on_gpu and self.split_head and _attention_kernel(self.model, self.config):
            self._use_kernel()
        # With the attention kernel: the decode passes' matrix products through kinfer's
        # row-invariant matmul (matmul.py), so that a row's logits do not depend on the pass
        # (drafts checked with it, other requests beside it).
        self.rows_matmul = False
        self.rows_reason = "MLX's matrix products"
        if self.kernel and rows:
            self.rows_matmul, self.rows_reason = mlx_matmul.prepare(self.model)
            log.info("mlx: row-invariant matmul %s (%s)", "on" if self.rows_matmul else "off", self.rows_reason)
        self.n_vocab = int(self.config.get("vocab_size") or len(self.vocab.pieces))
        flat = dict(_flat(self.model.parameters()))
        group = (self.config.get("quantization") or {}).get("group_size", 32)
        params = sum(
            flat[f"{k[:-7]}.scales"].size * group if f"{k[:-7]}.scales" in flat else v.size
            for k, v in flat.items()
            if not k.endswith((".scales", ".biases"))
        )
        size = sum(v.nbytes for v in flat.values())
        v = self.vocab
        mlx_version = mx.__dict__["__version__"]  # which MLX's stubs leave out
        self.info = ModelInfo(
            name=p.name,
            path=path,
            backend="mlx",
            n_vocab=self.n_vocab,
            context_length=options.context_length,
            slots=options.slots,
            architecture=str(self.config.get("model_type", "")),
            parameters=int(params),
            size_bytes=int(size),
            context_train=int(self.config.get("max_position_embeddings") or 0),
            description=f"{self.config.get('model_type', '')} on MLX {mlx_version} ({'gpu' if on_gpu else 'cpu'})",
            bos_text=v.pieces[v.bos].decode("utf-8", "replace") if v.bos is not None else "",
            eos_text=v.pieces[v.eos[0]].decode("utf-8", "replace") if v.eos else "",
            add_bos=v.add_bos,
            drafts=drafts,
            weights=self.weights,
        )
        log.info("mlx: %s weights (%s)", self.weights, self.weights_reason)
        progress(1.0)

    def _use_kernel(self) -> None:
        """Decode passes from now on through kinfer_mlx_attention's kernel (once it is routed)."""
        from kinfer_rpc.default_plugins.mlx import attention as mlx_attention

        self.kernel = -(-self.context // mlx_attention.CHUNK)
        heads = int(self.config.get("num_attention_heads") or 1)
        self.counter = mx.zeros((self.cells.slots * heads * (self.drafts + 1),), dtype=mx.int32)
        mx.eval(self.counter)

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.vocab.pieces[token] if 0 <= token < len(self.vocab.pieces) else b""

    def eog_tokens(self) -> frozenset[int]:
        return self.vocab.eog

    def chat_template(self) -> str | None:
        return self.vocab.template

    # -- decoding ---------------------------------------------------------------------------
    def _logits(self, inputs: mx.array, cache: Sequence[_Rows | _Traced], rows: mx.array | None = None) -> mx.array:
        """Logits of the forward over `inputs`; only `rows` (flat indices) when given."""
        if self.split_head:
            h: mx.array = self.model.model(inputs, cache)
            h = h.reshape(-1, h.shape[-1])
            if rows is not None:
                h = h[rows]
            m = self.model
            logits: mx.array = m.lm_head(h) if hasattr(m, "lm_head") else m.model.embed_tokens.as_linear(h)
            return logits
        out: mx.array = self.model(inputs, cache=cache)
        out = out.reshape(-1, out.shape[-1])
        return out if rows is None else out[rows]

    def _groups(self, chunks: Sequence[SeqChunk]) -> list[list[SeqChunk]]:
        """Chunks that share one forward: every decode chunk (a token, or a token and its drafts)
        in one; prompt chunks together while padding them to the longest wastes under a quarter.
        Each group is one weight read; every chunk, alone or not, takes the same path."""
        short = sorted((c for c in chunks if len(c.tokens) <= self.drafts + 1), key=lambda c: c.seq)
        groups = [short] if short else []
        group: list[SeqChunk] = []
        tokens = 0
        for c in sorted((c for c in chunks if len(c.tokens) > self.drafts + 1), key=lambda c: -len(c.tokens)):
            if group and len(group[0].tokens) * (len(group) + 1) * 4 > (tokens + len(c.tokens)) * 5:
                groups.append(group)
                group, tokens = [], 0
            group.append(c)
            tokens += len(c.tokens)
        groups += [group] if group else []
        return [sorted(g, key=lambda c: c.seq) for g in groups]

    def _step_fn(self, consecutive: bool, span: int) -> _Step:
        """A decode pass as a function of arrays only (for mx.compile): tokens (B, L), slots (B,),
        cols (B, L), pos (B,), the flat rows that want logits, and every layer's buffers; returns
        the logits and the updated buffers."""
        layers = self.layers

        def step(
            tokens: mx.array,
            slots: mx.array,
            cols: mx.array,
            pos: mx.array,
            rows: mx.array,
            keys: _Buffers,
            values: _Buffers,
        ) -> tuple[mx.array, _Buffers, _Buffers]:
            keys, values = list(keys), list(values)
            mask = None if self.kernel else (mx.arange(span, dtype=mx.int32)[None, None] <= cols[:, :, None])[:, None]
            first = slots[:1] if consecutive else None
            cache = [
                _Traced(keys, values, i, slots, cols, pos, mask, span, first, self.kernel, self.counter)
                for i in range(layers)
            ]
            with mlx_matmul.routed(self.rows_matmul):  # read as the pass is traced
                logits = self._logits(tokens, cache, rows)
            if self.kernel:
                # The kernel wrote the cells into the buffers in place, which MLX does not see:
                # the buffers handed on depend on the pass (every layer's kernel is upstream of
                # the logits), so that whatever reads them next (the next pass, a prompt's
                # scatter, a copy) runs after it, and evaluating them runs the pass.
                # (a compiled pass runs only once every layer has its buffers: no None among them)
                bufs = mx.depends(cast("list[mx.array]", keys + values), [logits])
                keys, values = bufs[:layers], bufs[layers:]
            return logits, keys, values

        return step

    def _buffers_ready(self) -> bool:
        """Every layer's buffers hold the cells the pass being built needs (a compiled pass
        cannot grow them)."""
        want = self.cells.want
        return all(k is not None and k.shape[2] >= want for k in self.cells.keys)

    def _compiled_step(self, seqs: list[int], last: int) -> _Step:
        """The compiled decode pass for rows of slots `seqs` whose last position is `last`: its
        trace replayed, not rebuilt op by op in Python, one per (slots consecutive or not, span)
        shape. The span is the cells a pass reads: up to `last` in blocks of STEP, or with the
        attention kernel the buffers' whole (it reads them in place; no retrace every STEP cells)."""
        cells = self.cells
        consecutive = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        span = cells.want if self.kernel else min(cells.want, -(-(last + 1) // STEP) * STEP)
        fn = self._compiled.get((consecutive, span))
        if fn is None:
            fn = self._compiled[(consecutive, span)] = mx.compile(self._step_fn(consecutive, span))
        return fn

    def _forward(self, group: Sequence[SeqChunk]) -> mx.array | None:
        """One forward over a group (row b: chunk b, padded to the longest); the logits of the
        rows that asked for them, in the group's order, or None."""
        cells = self.cells
        B, L = len(group), max(len(c.tokens) for c in group)
        pos = np.array([c.pos for c in group], dtype=np.int32)
        tokens = np.zeros((B, L), dtype=np.int32)
        want: list[int] = []
        for b, c in enumerate(group):
            tokens[b, : len(c.tokens)] = c.tokens
            want.extend(range(b * L + len(c.tokens) - c.outputs, b * L + len(c.tokens)))
        cols = pos[:, None] + np.arange(L, dtype=np.int32)[None]
        cells.reserve(int(cols.max()) + 1)
        seqs = [c.seq for c in group]
        fed = self._fed(group, mx.array(tokens), L)
        if L <= self.drafts + 1 and self.kernel and not self._buffers_ready():
            # Grown here, so that every decode pass takes the compiled path with the kernels,
            # not only those whose rows need no more cells (which depends on the other rows).
            cells.grow()
        if L <= self.drafts + 1 and self._buffers_ready():
            fn = self._compiled_step(seqs, int(cols.max()))
            want_a = mx.array(np.array(want or [0], dtype=np.int32))
            seq_a = mx.array(seqs, dtype=mx.int32)
            out, cells.keys, cells.values = fn(
                fed, seq_a, mx.array(cols), mx.array(pos), want_a, cells.keys, cells.values
            )
            return out if want else None
        span = min(cells.want, -(-int(cols.max() + 1) // STEP) * STEP)
        first = seqs[0] if seqs == list(range(seqs[0], seqs[0] + B)) else None
        # Row b's token i (at cols[b, i]) sees its own slot's cells up to its own position.
        mask = (np.arange(span, dtype=np.int32)[None, None] <= cols[:, :, None])[:, None]
        args = (mx.array(seqs, dtype=mx.int32), mx.array(cols), mx.array(pos), mx.array(mask), span, first)
        cache = [_Rows(cells, i, *args) for i in range(self.layers)]
        rows = mx.array(np.array(want or [0], dtype=np.int32))
        out = self._logits(fed, cache, rows)
        return out if want else None

    @staticmethod
    def _fed(group: Sequence[SeqChunk], tokens: mx.array, L: int) -> mx.array:
        """The (B, L) tokens of a forward with every chunk's device_tokens written in: per set of
        handles, one stack of its passes' tokens and one scatter into the flat tokens."""
        sets: dict[int, tuple[Sequence[mx.array], list[int], list[int]]] = {}
        for b, c in enumerate(group):
            if c.device_tokens is None:
                continue
            handles, row = c.device_tokens
            k = len(c.tokens) - 1
            if k > len(handles):
                raise ValueError(f"a chunk of {k} device tokens names {len(handles)} passes")
            _, src, dst = sets.setdefault(id(handles), (handles, [], []))
            src.extend(row * len(handles) + j for j in range(k))
            dst.extend(b * L + 1 + j for j in range(k))
        if not sets:
            return tokens
        flat = tokens.reshape(-1)
        for handles, src, dst in sets.values():
            drafts = mx.stack(list(handles), axis=1).reshape(-1).astype(mx.int32)
            flat[mx.array(np.array(dst, dtype=np.int32))] = drafts[mx.array(np.array(src, dtype=np.int32))]
        return flat.reshape(tokens.shape)

    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]:
        cells = self.cells
        for c in chunks:
            if c.pos != cells.length[c.seq]:
                raise ValueError(f"sequence {c.seq} holds {cells.length[c.seq]} cells; a chunk at {c.pos} leaves a gap")
        self._last = None
        pieces: list[mx.array] = []
        starts: dict[int, int] = {}
        n_out = 0
        with mx.stream(self.device):
            out: mx.array | None = None
            for group in self._groups(chunks):
                out = self._forward(group)
                if out is not None:
                    pieces.append(out)
                for c in group:
                    starts[id(c)] = n_out
                    n_out += c.outputs
            for c in chunks:
                cells.length[c.seq] = c.pos + len(c.tokens)
            result: mx.array | None = None
            ids: mx.array | None = None
            greedy = [c.seq in self._greedy for c in chunks for _ in range(c.outputs)]
            host = [i for i, g in enumerate(greedy) if not g]  # rows whose logits come back
            if n_out:
                index = [starts[id(c)] + i for c in chunks for i in range(c.outputs)]
                result = mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
                if index != list(range(n_out)):
                    result = result[mx.array(index)]
                if any(greedy):  # the argmax in the step's graph: only token ids come back
                    ids = mx.argmax(result, axis=1)
                    result = result[mx.array(host)].astype(mx.float32) if host else None
                else:
                    result = result.astype(mx.float32)
            # One evaluation for the whole step. When the last forward gives logits, every write
            # of the step is upstream of them (each layer's attention reads its written cells,
            # each group's writes go on from the group before): the outputs alone are named, as
            # mlx-lm does (naming 64 buffers too costs host time on every step). Otherwise the
            # cells are named.
            named = [a for a in (result, ids) if a is not None]
            async_eval: Callable[..., None] = mx.async_eval  # unannotated in MLX's stubs
            async_eval(*named, *(cells.arrays() if out is None or not named else ()))
            if ids is not None and all(greedy) and all(c.outputs == 1 for c in chunks):
                # (a chunk's one output row is its last token: a draft model's catch-up pass chains too)
                self._last = ([(c.seq, c.pos + len(c.tokens) - 1) for c in chunks], ids)
        n_vocab = self.n_vocab

        def logits() -> np.ndarray:
            self._sampled = (ids, greedy)
            if ids is not None:  # rows sampled here stay zeros; the others' logits in place
                out = np.zeros((n_out, n_vocab), dtype=np.float32)
                if result is not None:
                    out[host] = np.asarray(result)
                else:
                    mx.synchronize()
                return out
            if result is None:
                mx.synchronize()
                return np.zeros((0, n_vocab), dtype=np.float32)
            return np.asarray(result)

        return logits

    # -- greedy rows sampled on the device (the LoadedModel's optional contract) ---------------
    device_greedy = True
    decode_async = True  # mx.async_eval: decode() returns while the pass runs

    def set_device_greedy(self, seq: int, on: bool) -> bool:
        """From the next pass on, the output rows of `seq` end in an argmax in the pass's graph."""
        (self._greedy.add if on else self._greedy.discard)(seq)
        self._last = None
        return True

    # The DecodeChained capability: the next pass fed with the last one's argmax on the device
    # (what mlx-lm's generate_step does), queued at once, so the device computes it while the
    # engine takes the last pass's tokens. The engine uses it when its next step would plan
    # exactly those rows (greedy: unless a request ended, joined or was cancelled); otherwise it
    # waits for it and removes the cells it wrote (seq_remove).
    def decode_chained(self) -> Callable[[], np.ndarray]:
        last, self._last = self._last, None
        if last is None:
            raise ValueError("decode_chained follows only a pass of one device-greedy token a row")
        where, ids = last
        cells = self.cells
        order = sorted(range(len(where)), key=lambda b: where[b][0])
        seqs = [where[b][0] for b in order]
        pos = np.array([where[b][1] + 1 for b in order], dtype=np.int32)
        if int(pos.max()) + 1 >= self.context or int(pos.max()) + 1 > cells.want or not self._buffers_ready():
            raise ValueError("no room to chain a pass")
        B = len(seqs)
        with mx.stream(self.device):
            fn = self._compiled_step(seqs, int(pos.max()))
            tokens = ids[mx.array(order)].reshape(B, 1).astype(mx.int32)
            out, cells.keys, cells.values = fn(
                tokens,
                mx.array(seqs, dtype=mx.int32),
                mx.array(pos[:, None]),
                mx.array(pos),
                mx.arange(B, dtype=mx.int32),
                cells.keys,
                cells.values,
            )
            nxt = mx.argmax(out, axis=1)
            if order != list(range(B)):
                nxt = nxt[mx.array(np.argsort(order))]
            async_eval: Callable[..., None] = mx.async_eval  # unannotated in MLX's stubs
            async_eval(nxt)  # every layer's written cells are upstream of it
        for seq, p in where:
            cells.length[seq] = p + 2
        self._last = ([(seq, p + 1) for seq, p in where], nxt)
        n, n_vocab = len(where), self.n_vocab

        def logits() -> np.ndarray:
            self._sampled = (nxt, [True] * n)
            np.asarray(nxt)  # the wait
            return np.zeros((n, n_vocab), dtype=np.float32)

        return logits

    # The DeviceTokens capability: a draft model's rounds (decode, then decode_chained) handed
    # to the target's verify pass without reading them (tokens fed by device_tokens).
    feeds_device_tokens = True

    def launched_tokens(self) -> mx.array:
        """The device-greedy tokens of the pass launched last, one per row (before its wait)."""
        if self._last is None:
            raise ValueError("launched_tokens follows only a pass of one device-greedy token a row")
        return self._last[1]

    def sampled_tokens(self) -> list[int]:
        """After a pass's wait: the token of every output row sampled here, -1 for the others."""
        ids, greedy = self._sampled
        if ids is None:
            return [-1] * len(greedy)
        return [t if g else -1 for t, g in zip(np.asarray(ids).tolist(), greedy)]

    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        self._last = None
        held = self.cells.length[seq]
        if 0 <= end < held and start < end:
            raise NotImplementedError("the mlx backend removes cells from a position to the end only")
        self.cells.length[seq] = min(held, max(0, start))

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None:
        self._last = None
        if start != 0:
            raise NotImplementedError("the mlx backend copies a sequence's cells from position 0 only")
        c = self.cells
        n = c.length[src] if end < 0 else min(end, c.length[src])
        with mx.stream(self.device):
            for i in range(self.layers):
                keys, values = c.keys[i], c.values[i]
                if keys is not None:
                    assert values is not None  # made with the keys
                    keys[dst] = keys[src]
                    values[dst] = values[src]
        c.length[dst] = n

    def reproducible(self) -> tuple[bool, str]:
        """The CPU: MLX's matrix products give a row the same result whatever rows are beside it
        (tests/test_mlx.py). A GPU: MLX picks its matrix kernels by the number of rows in a pass
        (docs/performance.md); with kinfer's kernels (attention.py, matmul.py) a decode pass's
        rows are independent, but prompt passes still run MLX's, and how a prompt is split into
        passes depends on the other requests."""
        if self.device == mx.gpu:
            if self.rows_matmul:
                return False, (
                    "decode passes on the GPU run kinfer's row-invariant kernels (a token checked with drafts or "
                    "beside other requests gets the logits it gets alone), but prompt passes run MLX's, which it "
                    "picks by the number of rows in a pass, and how a prompt is split into passes depends on the "
                    "other requests"
                )
            return False, "MLX on a GPU picks its matrix kernels by the number of rows in a pass"
        return True, "MLX on the CPU, whose matrix products give a row the same result whatever rows are beside it"

    def memory(self) -> dict[str, Any]:
        return {
            "modelBytes": self.info.size_bytes,
            "contextCells": self.cells.slots * self.context,
            "kvBytes": self.cells.nbytes(),
            "kvType": "f16",
            "device": "gpu" if self.device == mx.gpu else "cpu",
        }

    def close(self) -> None:
        self.model = None
        self.cells = _Cells(self.cells.slots, 0)
        mx.clear_cache()
