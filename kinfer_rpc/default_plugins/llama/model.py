"""A GGUF model that generates, loaded into one llama.cpp context.

One llama_context per load with `slots` sequences. Each `decode` fills one llama_batch from numpy
arrays we own (no per-token ctypes calls) and makes one llama_decode call; the logits of the rows
that asked for them come back in batch order from llama_get_logits.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kinfer_rpc import errors
from kinfer_rpc.default_plugins import cpu_share
from kinfer_rpc.default_plugins.llama import buft, library, rpc
from kinfer_rpc.default_plugins.llama.batch import Batch
from kinfer_rpc.default_plugins.llama.vocab import LlamaVocab
from kinfer_rpc.types import FIM_KEYS, LoadOptions, Media, ModelInfo, SeqChunk

if TYPE_CHECKING:
    from kinfer_rpc.default_plugins.llama.mtp import Mtp
    from kinfer_rpc.default_plugins.llama.vision import Projector

log = logging.getLogger("kinfer_rpc.llama")
_KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type ids


def split_params(L: ModuleType, mparams: Any, options: LoadOptions, local_gpu: bool) -> Any:
    """Set how llama_model_params `mparams` spreads the offloaded layers over the devices:
    tensor_split, split_mode and main_gpu from the load options that set them (llama.cpp's
    defaults stay otherwise). Without a GPU on this host or an RPC server the split mode and main
    GPU are left alone: llama.cpp would look for the main GPU among no devices and fail the load.
    Returns the tensor_split array, which must live as long as the load."""
    shares = None
    if options.tensor_split:
        # llama.cpp reads llama_max_devices() (16) floats
        shares = (ctypes.c_float * max(16, len(options.tensor_split)))(*options.tensor_split)
        mparams.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
    if local_gpu or options.rpc_servers:
        if options.split_mode is not None:
            mparams.split_mode = {
                "none": L.LLAMA_SPLIT_MODE_NONE,
                "layer": L.LLAMA_SPLIT_MODE_LAYER,
                "row": L.LLAMA_SPLIT_MODE_ROW,
                "tensor": L.LLAMA_SPLIT_MODE_TENSOR,
            }[options.split_mode]
        if options.main_gpu is not None:
            mparams.main_gpu = options.main_gpu
    return shares


def check_row_split(g: buft.Ggml) -> None:
    """RuntimeError unless every GPU's ggml backend has the split buffers split mode row puts each
    weight matrix in (llama.cpp would fail the load with a bare error). ggml-cuda, as the llama.cpp
    kinfer builds vendors it, has none: it cuts matrices over GPUs with split mode tensor."""
    for i in range(g.dev_count() if g.dev_count else 0):
        dev = g.dev_get(i)
        if g.dev_type(dev) in (buft.DEVICE_GPU, buft.DEVICE_IGPU) and not g.row_split(i):
            name = (g.dev_name(dev) or b"").decode() if g.dev_name else str(i)
            raise RuntimeError(
                f"splitMode row needs split buffers, which this llama.cpp's backend of {name} does not have; "
                "splitMode tensor cuts every matrix over the GPUs instead, splitMode layer gives each a range of layers"
            )


class LlamaModel(LlamaVocab):
    """A GGUF model loaded into one llama.cpp context (the LoadedModel contract)."""

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> None:
        L = self.L = library.load()
        most = int(L.llama_max_parallel_sequences())
        if options.slots > most:  # llama.cpp would refuse the context after the weights are read
            raise errors.invalid_params(
                f"options.slots: llama.cpp runs at most {most} sequences at once, not {options.slots}",
                {"field": "options.slots"},
            )
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = options.gpu_layers if options.gpu_layers >= 0 else 999
        # (A llama.cpp built with its RPC backend says it supports offload whatever the machine
        # has: ask for this host's GPUs.)
        gpu_types = (buft.DEVICE_GPU, buft.DEVICE_IGPU)
        local_gpu = any(d["type"] in gpu_types for d in buft.Ggml().devices())
        self.on_cpu = (options.gpu_layers == 0 or not local_gpu or not L.llama_supports_gpu_offload()) and not (
            options.rpc_servers and options.gpu_layers != 0
        )
        self._rpc: rpc.Servers | None = None
        self._split: Any = None
        if options.split_mode == "row" and local_gpu:
            check_row_split(buft.Ggml())
        if options.rpc_servers:
            # The servers' devices (after this host's GPUs) take the offloaded layers.
            self._rpc = rpc.Servers(options.rpc_servers)
            mparams.devices = ctypes.cast(self._rpc.array, ctypes.c_void_p)
        self._split = split_params(L, mparams, options, local_gpu)
        # Where the layers went, from llama.cpp's log: over RPC servers, or split over this host's GPUs.
        layer_map = self._rpc is not None or (local_gpu and options.split_mode in ("layer", "row", "tensor"))
        if layer_map:
            rpc.capture_start()
        # On a GPU llama_decode returns once the pass is queued (see decode).
        self.decode_async = not self.on_cpu
        self._overrides: buft.Overrides | None = None
        if options.host_tensors:
            # Tensors matching these patterns stay in host memory (the CPU buffer type); on a
            # GPU, big passes still run their matrix products there, copying the weights over
            # once per pass. Reading the file into (pinned) buffers instead of mapping it makes
            # those copies faster, as llama.cpp itself advises for CPU overrides.
            self._overrides = buft.Overrides(L, options.host_tensors, buft.Ggml().cpu_buft())
            mparams.tensor_buft_overrides = self._overrides.pointer
            mparams.load_mode = L.LLAMA_LOAD_MODE_NONE

        def on_progress(fraction: float, _user: Any) -> bool:
            progress(float(fraction))
            return True

        self._progress_cb = L.llama_progress_callback(on_progress)
        mparams.progress_callback = self._progress_cb
        if options.mtp:
            mparams.load_mtp = True  # otherwise llama.cpp skips the NextN tensors
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        devices: tuple[dict[str, Any], ...] = ()
        if layer_map:
            names = self._rpc.names if self._rpc is not None else {}
            devices = rpc.capture_end(names, L.llama_model_n_layer(self.model) if self.model else 0)
        if self._rpc is not None:
            if not self.model:
                self._rpc.release()
                self._rpc.check()  # a server that failed during the load is named
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path!r} (not a GGUF file it can read?)")
        self._mtp: Mtp | None = None
        # With the patched llama.cpp the pass takes greedy rows' argmax (set_device_greedy).
        self._set_argmax, self._get_argmax = library.output_argmax()
        self.device_greedy = self._set_argmax is not None
        self._greedy: set[int] = set()  # sequences whose rows' argmax the pass takes
        self._argmax: set[int] = set()  # sequences whose rows' argmax it takes, their logits copied back too
        self._argmax_mode = 0
        self._next_ok = False  # whether decode_next may repeat the last pass (see decode)
        self._n_out = 0  # the last pass's output rows
        self._rows_greedy: list[bool] | None = None  # per output row, at its decode (mode 1)
        if options.mtp and L.llama_model_n_layer_nextn(self.model) == 0:
            L.llama_model_free(self.model)
            self.model = None
            raise ValueError("this model has no multi-token-prediction layers (nextn); draftPolicy mtp needs one")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

        cparams = L.llama_context_default_params()
        slots = options.slots
        cparams.n_seq_max = slots
        # Without a unified buffer llama.cpp gives each sequence n_ctx / n_seq_max cells.
        cparams.n_ctx = options.context_length * (1 if options.kv_unified else slots)
        cparams.n_batch = options.batch
        cparams.n_ubatch = min(options.ubatch, options.batch)
        threads = options.threads or self.default_threads(options)
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        # A CPU load that names no thread count computes with the cores other processes leave free.
        self._share = cpu_share.CpuShare(threads) if self.on_cpu and not options.threads else None
        cparams.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.kv_unified = options.kv_unified
        # The KV cache type decides which flash-attention kernel runs on the CPU. With f16 cells
        # ggml picks by the pass's shape: a tiled kernel for 64+ rows of one sequence, a split-KV
        # kernel for a lone one-row sequence over 512+ cells, a row-by-row one otherwise; each
        # rounds differently, so a reply would depend on how it was scheduled. With q8_0 cells
        # every pass takes the row-by-row kernel: replies are the same however they are batched
        # or chunked (tests/test_invariance.py). The GPU keeps f16 unless asked.
        kv_type = options.kv_type or ("q8_0" if self.on_cpu and options.reproducible is not False else "f16")
        cparams.type_k = cparams.type_v = _KV_TYPES[kv_type]
        self.kv_type = kv_type
        self._reproducible = self._promise(options)
        # A sequence checking k drafts needs k + 1 logits rows in one pass.
        drafts = options.drafts if options.drafts is not None else self.default_drafts()
        cparams.n_outputs_max_per_seq = drafts + 1
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise errors.KinferError(  # most often: the cells or the batch's buffers do not fit the memory
                errors.LOAD_FAILED,
                f"llama.cpp could not create a context of {cparams.n_ctx} cells for {slots} slots"
                f" (batch {cparams.n_batch}): not enough memory for its cells and buffers?",
            )
        self.mem = L.llama_get_memory(self.ctx)
        self._batch = Batch(L, options.batch)
        if options.mtp:
            try:
                from kinfer_rpc.default_plugins.llama.mtp import Mtp

                self._mtp = Mtp(self, cparams, options.batch, options.kv_unified)
            except BaseException:
                self.close()
                raise
        self._projector: Projector | None = None
        self.vision = False
        if options.projector and self._mtp is not None:
            self.close()
            # the MTP head follows the target's passes over tokens; an image's pass has none
            raise ValueError("a model loaded with draftPolicy mtp takes no vision projector (options.projector)")
        if options.projector:
            try:
                from kinfer_rpc.default_plugins.llama.vision import Projector

                self._projector = Projector(
                    L, self.model, options.projector, threads=threads, use_gpu=not self.on_cpu, tokenize=self.tokenize
                )
                self.vision = True
            except BaseException:
                self.close()
                raise
        self._batch_size = options.batch
        self._pieces: dict[int, bytes] = {}
        # Asked once per generated token: a set lookup, not a call into the library.
        self._eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        ctx_seq = L.llama_n_ctx_seq(self.ctx) if hasattr(L, "llama_n_ctx_seq") else options.context_length
        self.info = ModelInfo(
            name=os.path.basename(path),
            path=path,
            backend="llama",
            n_vocab=self.n_vocab,
            context_length=int(ctx_seq),
            slots=slots,
            architecture=self.meta("general.architecture") or "",
            parameters=int(L.llama_model_n_params(self.model)),
            size_bytes=int(L.llama_model_size(self.model)),
            context_train=int(L.llama_model_n_ctx_train(self.model)),
            description=self._desc(),
            bos_text=self._special_text(L.llama_vocab_bos(self.vocab)),
            eos_text=self._special_text(L.llama_vocab_eos(self.vocab)),
            add_bos=bool(L.llama_vocab_get_add_bos(self.vocab)),
            drafts=drafts,
            devices=devices,
        )

    # CPU threads for a load that names none while every layer and the output are on the GPU.
    GPU_THREADS = 2

    def _promise(self, options: LoadOptions) -> tuple[bool, str]:
        """Whether this load's passes are batch-invariant (Reproducible), and why: measured in
        tests/test_invariance.py on the CPU and bench/gpu_invariance.sh on CUDA."""
        if not options.flash_attention:
            return False, "flash attention is off: llama.cpp's attention is then chosen by the shape of each pass"
        if options.kv_unified:
            return False, "one KV buffer for every slot: a reply's attention depends on its neighbours' cells"
        if options.rpc_servers:
            return False, "layers on RPC servers run kernels kinfer does not choose (their devices' own)"
        if options.split_mode == "row" and not self.on_cpu:
            return False, (
                "splitMode row: matrices cut over several GPUs run kernels that kinfer's batch-invariant build "
                "does not cover"
            )
        if options.split_mode == "tensor" and not self.on_cpu:
            return False, (
                "splitMode tensor: each matrix product is cut over the GPUs and their parts summed across them, "
                "which kinfer's batch-invariant build does not cover"
            )
        if self.on_cpu:
            if self.kv_type != "q8_0":
                return False, (
                    f"{self.kv_type} KV cells on the CPU: llama.cpp's flash attention picks differently rounding "
                    "kernels by the shape of each pass (kvType q8_0 keeps the promise)"
                )
            return True, "the CPU with flash attention, one KV stream per slot and q8_0 KV cells"
        layers = self.L.llama_model_n_layer(self.model)
        if 0 <= options.gpu_layers <= layers or options.host_tensors:
            return False, "layers or tensors split between the CPU and the GPU are not made batch-invariant"
        if self.kv_type != "f16":
            return False, f"{self.kv_type} KV cells on the GPU are not covered by the batch-invariant kernels"
        return library.cuda_kernels(options.reproducible)

    def reproducible(self) -> tuple[bool, str]:
        return self._reproducible

    def default_threads(self, options: LoadOptions) -> int:
        """The machine's CPU count, unless every layer and the output layer are on the GPU with no
        tensor kept in host memory: llama.cpp's CPU threads then only look up the prompt's token
        embeddings, and its workers spin between passes, on the cores the engine's own host work
        (the argmax over the logits, the next pass's planning) needs while the GPU waits for it.
        On the H200 (1.1B shape, 128 at once) 2 threads instead of 8 took `prefix -1` from 80% to
        85% of llama-batched-bench (docs/performance.md)."""
        cpus = max(1, os.cpu_count() or 1)
        layers = self.L.llama_model_n_layer(self.model)
        every = options.gpu_layers < 0 or options.gpu_layers > layers  # the output layer is one more
        if self.on_cpu or not every or options.host_tensors:
            return cpus
        return min(cpus, self.GPU_THREADS)

    def default_drafts(self) -> int:
        """Drafts per step when a load names no count, from the measured cost of a pass over
        k+1 positions (docs/performance.md). On the H200 (7B shape) llama.cpp's CUDA
        matrix-vector kernels pay for each row up to 8 (k=4: 1.77x one position), then the
        matrix kernel takes over and 9 to 16 rows cost about 2.0x: 8 drafts for that price.
        On the CPU (2 cores, SmolLM2-135M) every extra row costs about half a pass (k=1: 1.58x,
        k=2: 2.3x, k=4: 3.5x), so only a draft accepted more often than not pays: 1."""
        return 1 if self.on_cpu else 8

    def chat_template(self) -> str | None:
        t = self.L.llama_model_chat_template(self.model, None)
        return t.decode("utf-8") if t else None

    def eog_tokens(self) -> frozenset[int]:
        return self._eog

    def fim_tokens(self) -> dict[str, int]:
        """The fill-in-the-middle tokens llama.cpp found: the GGUF's tokenizer.ggml.fim_*_token_id
        keys, else the usual spellings in the vocabulary (the FillInMiddle capability)."""
        found = {key: int(getattr(self.L, f"llama_vocab_fim_{key}")(self.vocab)) for key in FIM_KEYS}
        return {key: token for key, token in found.items() if 0 <= token < self.n_vocab}

    # -- decoding ---------------------------------------------------------------------------
    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]:
        total = sum(len(c.tokens) for c in chunks)
        if total > self._batch.capacity:
            raise ValueError(f"a pass of {total} tokens exceeds the batch size {self._batch.capacity}")
        n_out = self._n_out = self._batch.fill(chunks)
        # decode_next may repeat this pass one token further: every row one token, with its logits.
        self._next_ok = self._mtp is None and n_out == total
        return self._launch(chunks, total, n_out)

    def decode_next(self, tokens: Sequence[int]) -> Callable[[], np.ndarray]:
        """The last pass's rows again, each one token further on: row i's sequence gets tokens[i]
        at the next position. Only after a pass of one token a row, each asking for its logits
        (the engine's steady decode step); the batch is updated in place, with no chunks to read."""
        n = self._batch.batch.n_tokens
        if not (self._next_ok and n and len(tokens) == n):
            # Nor after cells were removed or copied, or a sequence's argmax moved, since then.
            raise ValueError("decode_next follows only a pass of one token a row, with as many tokens")
        b = self._batch
        b.token[:n] = tokens
        b.pos[:n] += 1
        return self._launch(None, n, n)

    def _launch(self, chunks: Sequence[SeqChunk] | None, total: int, n_out: int) -> Callable[[], np.ndarray]:
        if self._argmax_mode and chunks is not None:  # decode_next: the rows, so the mode, are the same
            # Every row greedy: only the token ids come back, not n_vocab logits a row.
            greedy = self._greedy
            mode = 2 if all(c.seq in greedy for c in chunks if c.outputs) else 1
            # Which rows the pass samples, for a pass that also copies logits back.
            taken = greedy | self._argmax
            self._rows_greedy = None if mode == 2 else [c.seq in taken for c in chunks for _ in range(c.outputs)]
            if mode != self._argmax_mode:
                assert self._set_argmax is not None, "an argmax mode is set only through it"
                self._set_argmax(self.ctx, mode)
                self._argmax_mode = mode
        if self._share is not None and (threads := self._share.threads) != (now := self._share.now()):
            log.debug("computing with %d CPU threads instead of %d (the other processes' load)", now, threads)
            self.L.llama_set_n_threads(self.ctx, now, now)
        # On a GPU llama_decode returns once the pass is queued; reading the logits waits for it.
        rc = self.L.llama_decode(self.ctx, self._batch.batch)
        if rc != 0:
            self._next_ok = False
            if self._rpc is not None:
                self._rpc.check()
            raise RuntimeError(f"llama_decode failed with code {rc}")
        rpc = self._rpc

        def logits() -> np.ndarray:
            if rpc is not None:  # a server that failed during the pass left zeros, not logits
                self.L.llama_synchronize(self.ctx)
                rpc.check()
            if n_out == 0:
                self.L.llama_synchronize(self.ctx)
                return np.zeros((0, self.n_vocab), dtype=np.float32)
            # A view of llama.cpp's own buffer: no copy; valid until the next decode.
            ptr = self.L.llama_get_logits(self.ctx)
            return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

        if self._mtp is None:
            return logits
        mtp = self._mtp
        assert chunks is not None, "decode_next is refused while the MTP context follows the target"

        def logits_and_mirror() -> np.ndarray:
            # The MTP pass needs the target's hidden states, so it is started once the target's
            # pass is done; on a GPU it is queued, not waited for (the drafts read it later).
            out = logits()
            mtp.follow(chunks, total)
            return out

        return logits_and_mirror

    # The argmax of greedy rows in the pass's graph (the engine's device_greedy contract), with
    # llama.cpp patched (patches/llama-output-argmax.patch): one argmax over every output row,
    # copied back as token ids; a pass whose rows are all greedy copies no logits at all.
    # Without the patch the engine takes the argmax over the logits itself. An exact tie between
    # the largest logits may be broken differently than numpy's argmax (lowest id) does; a
    # greedy request's rows always take this path while the patch is there, so its reply is
    # still the same whatever runs beside it.
    def set_device_greedy(self, seq: int, on: bool) -> bool:
        if self._set_argmax is None:
            return False
        self._next_ok = False
        (self._greedy.add if on else self._greedy.discard)(seq)
        self._argmax_joins(on)
        return True

    def set_device_argmax(self, seq: int, on: bool) -> bool:
        """The DeviceArgmax capability: a mode-1 pass takes every output row's argmax and still
        copies the logits back, so a row that is masked first (a grammar) reads both."""
        if self._set_argmax is None:
            return False
        self._next_ok = False
        (self._argmax.add if on else self._argmax.discard)(seq)
        self._argmax_joins(on)
        return True

    def _argmax_joins(self, on: bool) -> None:
        if on and not self._argmax_mode:
            assert self._set_argmax is not None, "called only with the patched library"
            self._set_argmax(self.ctx, 1)  # the argmax joins the graph (llama.cpp plans it again)
            self._argmax_mode = 1
        elif not self._greedy and not self._argmax and self._argmax_mode:
            assert self._set_argmax is not None, "called only with the patched library"
            self._set_argmax(self.ctx, 0)  # no sequence greedy: the graph leaves the argmax out
            self._argmax_mode = 0

    def sampled_tokens(self) -> list[int]:
        """After a pass's wait: each output row's argmax where its sequence is greedy, else -1."""
        n_out = self._n_out
        if not self._argmax_mode or not n_out:
            return [-1] * n_out
        assert self._get_argmax is not None, "an argmax mode is set only with the patched library"
        ptr = self._get_argmax(self.ctx)
        if not ptr:
            return [-1] * n_out
        ids: list[int] = np.ctypeslib.as_array(ptr, shape=(n_out,)).tolist()
        if self._rows_greedy is None:  # mode 2: no logits came back to fall back on
            if min(ids) < 0:  # a row of NaN or -inf logits has no argmax
                raise RuntimeError("the model produced logits without a largest value (NaN) for a greedy row")
            return ids
        return [t if g else -1 for t, g in zip(ids, self._rows_greedy)]

    # -- images (the Vision capability, with a projector: vision.py) ----------------------------
    def media_prompt(self, pieces: Sequence[str | bytes], add_special: bool) -> tuple[list[int], list[Media]]:
        if self._projector is None:
            raise ValueError("this model was loaded without a vision projector: it reads no images")
        return self._projector.prompt(pieces, add_special)

    def eval_media(self, seq: int, media: Media, pos: int) -> None:
        if self._projector is None:
            raise ValueError("this model was loaded without a vision projector: it reads no images")
        self._next_ok = False
        self._projector.eval(self.ctx, seq, media, pos, self._batch_size)

    def media_stats(self) -> dict[str, int]:
        return self._projector.stats() if self._projector is not None else {}

    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        self._next_ok = False
        self.L.llama_memory_seq_rm(self.mem, seq, start, end)
        if self._mtp is not None:
            self._mtp.seq_remove(seq, start, end)

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None:
        self._next_ok = False
        self.L.llama_memory_seq_cp(self.mem, src, dst, start, end)
        if self._mtp is not None:
            self._mtp.seq_copy(src, dst, start, end)

    def can_shift(self) -> bool:
        """Whether cells can move (ShiftsCells): llama.cpp's cache allows it (not M-RoPE, not a
        recurrent model) and no multi-token-prediction head keeps cells of its own beside them."""
        return self._mtp is None and bool(self.L.llama_memory_can_shift(self.mem))

    def seq_shift(self, seq: int, start: int, end: int, delta: int) -> None:
        self._next_ok = False
        self.L.llama_memory_seq_add(self.mem, seq, start, end, delta)

    def memory(self) -> dict[str, Any]:
        return {
            "modelBytes": self.info.size_bytes,
            "contextCells": int(self.L.llama_n_ctx(self.ctx)),
            "kvType": self.kv_type,
            "device": "cpu" if self.on_cpu else "gpu",
        }

    def close(self) -> None:
        if self._mtp is not None:
            self._mtp.close()
            self._mtp = None
        if getattr(self, "_projector", None) is not None:
            assert self._projector is not None
            self._projector.close()
            self._projector = None
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None
        if self._rpc is not None:
            self._rpc.release()
