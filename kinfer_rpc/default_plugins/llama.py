"""The `llama` backend: llama.cpp through llama-cpp-python's low-level API.

One llama_context per load with `slots` sequences. Each `decode` fills one llama_batch from numpy
arrays we own (no per-token ctypes calls) and makes one llama_decode call; the logits of the rows
that asked for them come back in batch order from llama_get_logits.

With `LoadOptions.mtp` the model's multi-token-prediction (NextN) layers load too and a second
context runs them (llama_mtp.Mtp): after every pass of the target it is caught up with the same tokens,
each paired with the target's hidden state of the position before, so its memory mirrors the
target's; the `mtp` draft policy drafts from it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

import kinfer_rpc
from kinfer_rpc.default_plugins import cpu_share, llama_buft, llama_native, llama_rpc
from kinfer_rpc.types import (
    FIM_KEYS,
    Backend,
    DraftPolicy,
    DraftRequest,
    GpuInfo,
    LoadedModel,
    LoadOptions,
    MachineInfo,
    ModelInfo,
    SeqChunk,
)

if TYPE_CHECKING:
    from kinfer_rpc.default_plugins.llama_mtp import Mtp

log = logging.getLogger("kinfer_rpc.llama")
_init_lock = threading.Lock()
_initialised = False
_log_callback: object = None  # kept alive: llama.cpp holds the pointer
_KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type ids
_cuda_lock = threading.Lock()
_cuda_invariant: bool | None = None  # the switch as this process's first GPU load found or set it


def _cuda_kernels(reproducible: bool | None) -> tuple[bool, str]:
    """Before a load with every layer on the GPU: whether its kernels will be batch-invariant,
    and why. ggml-cuda reads its switch once per process, at its first pass; a load asking for
    speed (reproducible false) turns it off when it is the first and the environment says
    nothing. Later loads get what the first one set."""
    global _cuda_invariant
    if not llama_native.cuda_batch_invariant():
        return False, (
            "this llama.cpp's GPU kernels are chosen by the shape of each pass, so a reply depends on what "
            "else runs (kinfer's llama.cpp build has batch-invariant CUDA kernels: patches/README.md)"
        )
    switch = llama_native.CUDA_SWITCH
    with _cuda_lock:
        if _cuda_invariant is None:
            if reproducible is False and switch not in os.environ:
                os.environ[switch] = "0"
            value = os.environ.get(switch)
            _cuda_invariant = value is None or _leading_int(value) != 0
        on = _cuda_invariant
    if on:
        return True, "CUDA with kinfer's batch-invariant kernels, every layer on the GPU, flash attention, f16 KV cells"
    return False, (
        f"CUDA with llama.cpp's own kernels ({switch}=0, set for this process by its first GPU load or its "
        "environment), which are chosen by the shape of each pass"
    )


def _leading_int(text: str) -> int:
    """C's atoi, as ggml-cuda reads its switch."""
    digits = text.strip()
    sign = -1 if digits[:1] == "-" else 1
    digits = digits.lstrip("+-")
    n = len(digits) - len(digits.lstrip("0123456789"))
    return sign * int(digits[:n]) if n else 0


def _llama() -> ModuleType:
    """Import llama_cpp lazily and once: it loads a native library and may print. Through
    kinfer_llama_native, which refuses a library that would crash this process."""
    global _initialised, _log_callback
    L = llama_native.load()

    with _init_lock:
        if not _initialised:

            def forward(level: int, text: bytes, _user: Any) -> None:
                # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. Loads log a lot:
                # keep info at debug so a user sees only what needs them.
                msg = text.decode("utf-8", "replace").rstrip()
                llama_rpc.capture_line(msg)
                if msg:
                    log.log({3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG), "%s", msg)

            _log_callback = L.llama_log_callback(forward)
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            # llama-cpp-python 0.3.36 leaves tensor_buft_overrides unbound (patches/README.md).
            llama_buft.apply(L)
            global _set_output_argmax, _get_output_argmax
            _set_output_argmax, _get_output_argmax = _bind_output_argmax()
            _initialised = True
    return L


class _Batch:
    """A llama_batch whose arrays are numpy buffers we own, so filling it is vectorised."""

    def __init__(self, L: ModuleType, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        ptr_t = ctypes.POINTER(ctypes.c_int32)
        self.seq_ptrs = (ptr_t * capacity)()
        base = self.seq.ctypes.data
        for i in range(capacity):
            self.seq_ptrs[i] = ctypes.cast(base + 4 * i, ptr_t)
        self.batch = L.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ptr_t)
        self.batch.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ptr_t))
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, chunks: Sequence[SeqChunk]) -> int:
        # One numpy assignment per array for the whole pass: per-chunk slicing costs more than
        # the pass itself when 128 sequences each bring one token.
        tokens: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        out: list[int] = []
        for c in chunks:
            k = len(c.tokens)
            tokens.extend(c.tokens)
            if k == 1:
                pos.append(c.pos)
                seq.append(c.seq)
                out.append(1 if c.outputs else 0)
            else:
                pos.extend(range(c.pos, c.pos + k))
                seq.extend([c.seq] * k)
                out.extend([0] * (k - c.outputs) + [1] * c.outputs)
        n = len(tokens)
        self.token[:n] = tokens
        self.pos[:n] = pos
        self.seq[:n] = seq
        self.logits[:n] = out
        self.batch.n_tokens = n
        return sum(out)


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


def check_row_split(g: llama_buft.Ggml) -> None:
    """RuntimeError unless every GPU's ggml backend has the split buffers split mode row puts each
    weight matrix in (llama.cpp would fail the load with a bare error). ggml-cuda, as the llama.cpp
    kinfer builds vendors it, has none: it cuts matrices over GPUs with split mode tensor."""
    for i in range(g.dev_count() if g.dev_count else 0):
        dev = g.dev_get(i)
        if g.dev_type(dev) in (llama_buft.DEVICE_GPU, llama_buft.DEVICE_IGPU) and not g.row_split(i):
            name = (g.dev_name(dev) or b"").decode() if g.dev_name else str(i)
            raise RuntimeError(
                f"splitMode row needs split buffers, which this llama.cpp's backend of {name} does not have; "
                "splitMode tensor cuts every matrix over the GPUs instead, splitMode layer gives each a range of layers"
            )


class LlamaVocab:
    """What a llama.cpp model's file and vocabulary say (metadata, tokens), for the backend's
    generating and embedding models alike: they set `L`, `model`, `vocab` and `_pieces`."""

    L: Any
    model: Any
    vocab: Any
    _pieces: dict[int, bytes]

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _desc(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self.L.llama_model_desc(self.model, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.token_bytes(token).decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self.L.llama_token * cap)()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (self.L.llama_token * cap)()
            n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
            piece = self._pieces[token] = buf.raw[:n]
        return piece


class LlamaModel(LlamaVocab):
    """A GGUF model loaded into one llama.cpp context (the LoadedModel contract)."""

    def __init__(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> None:
        L = self.L = _llama()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = options.gpu_layers if options.gpu_layers >= 0 else 999
        # (A llama.cpp built with its RPC backend says it supports offload whatever the machine
        # has: ask for this host's GPUs.)
        gpu_types = (llama_buft.DEVICE_GPU, llama_buft.DEVICE_IGPU)
        local_gpu = any(d["type"] in gpu_types for d in llama_buft.Ggml().devices())
        self.on_cpu = (options.gpu_layers == 0 or not local_gpu or not L.llama_supports_gpu_offload()) and not (
            options.rpc_servers and options.gpu_layers != 0
        )
        self._rpc: llama_rpc.Servers | None = None
        self._split: Any = None
        if options.split_mode == "row" and local_gpu:
            check_row_split(llama_buft.Ggml())
        if options.rpc_servers:
            # The servers' devices (after this host's GPUs) take the offloaded layers.
            self._rpc = llama_rpc.Servers(options.rpc_servers)
            mparams.devices = ctypes.cast(self._rpc.array, ctypes.c_void_p)
        self._split = split_params(L, mparams, options, local_gpu)
        # Where the layers went, from llama.cpp's log: over RPC servers, or split over this host's GPUs.
        layer_map = self._rpc is not None or (local_gpu and options.split_mode in ("layer", "row", "tensor"))
        if layer_map:
            llama_rpc.capture_start()
        # On a GPU llama_decode returns once the pass is queued (see decode).
        self.decode_async = not self.on_cpu
        self._overrides: llama_buft.Overrides | None = None
        if options.host_tensors:
            # Tensors matching these patterns stay in host memory (the CPU buffer type); on a
            # GPU, big passes still run their matrix products there, copying the weights over
            # once per pass. Reading the file into (pinned) buffers instead of mapping it makes
            # those copies faster, as llama.cpp itself advises for CPU overrides.
            self._overrides = llama_buft.Overrides(L, options.host_tensors, llama_buft.Ggml().cpu_buft())
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
            devices = llama_rpc.capture_end(names, L.llama_model_n_layer(self.model) if self.model else 0)
        if self._rpc is not None:
            if not self.model:
                self._rpc.release()
                self._rpc.check()  # a server that failed during the load is named
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path!r} (not a GGUF file it can read?)")
        self._mtp: Mtp | None = None
        # With the patched llama.cpp the pass takes greedy rows' argmax (set_device_greedy).
        self.device_greedy = _set_output_argmax is not None
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
            raise RuntimeError(f"llama.cpp could not create a context of {cparams.n_ctx} cells for {slots} slots")
        self.mem = L.llama_get_memory(self.ctx)
        self._batch = _Batch(L, options.batch)
        if options.mtp:
            try:
                from kinfer_rpc.default_plugins.llama_mtp import Mtp

                self._mtp = Mtp(self, cparams, options.batch, options.kv_unified)
            except BaseException:
                self.close()
                raise
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
        return _cuda_kernels(options.reproducible)

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
                assert _set_output_argmax is not None, "an argmax mode is set only through it"
                _set_output_argmax(self.ctx, mode)
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
        if _set_output_argmax is None:
            return False
        self._next_ok = False
        (self._greedy.add if on else self._greedy.discard)(seq)
        self._argmax_joins(on)
        return True

    def set_device_argmax(self, seq: int, on: bool) -> bool:
        """The DeviceArgmax capability: a mode-1 pass takes every output row's argmax and still
        copies the logits back, so a row that is masked first (a grammar) reads both."""
        if _set_output_argmax is None:
            return False
        self._next_ok = False
        (self._argmax.add if on else self._argmax.discard)(seq)
        self._argmax_joins(on)
        return True

    def _argmax_joins(self, on: bool) -> None:
        if on and not self._argmax_mode:
            assert _set_output_argmax is not None, "called only with the patched library"
            _set_output_argmax(self.ctx, 1)  # the argmax joins the graph (llama.cpp plans it again)
            self._argmax_mode = 1
        elif not self._greedy and not self._argmax and self._argmax_mode:
            assert _set_output_argmax is not None, "called only with the patched library"
            _set_output_argmax(self.ctx, 0)  # no sequence greedy: the graph leaves the argmax out
            self._argmax_mode = 0

    def sampled_tokens(self) -> list[int]:
        """After a pass's wait: each output row's argmax where its sequence is greedy, else -1."""
        n_out = self._n_out
        if not self._argmax_mode or not n_out:
            return [-1] * n_out
        assert _get_output_argmax is not None, "an argmax mode is set only with the patched library"
        ptr = _get_output_argmax(self.ctx)
        if not ptr:
            return [-1] * n_out
        ids: list[int] = np.ctypeslib.as_array(ptr, shape=(n_out,)).tolist()
        if self._rows_greedy is None:  # mode 2: no logits came back to fall back on
            if min(ids) < 0:  # a row of NaN or -inf logits has no argmax
                raise RuntimeError("the model produced logits without a largest value (NaN) for a greedy row")
            return ids
        return [t if g else -1 for t, g in zip(ids, self._rows_greedy)]

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
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None
        if self._rpc is not None:
            self._rpc.release()


def _bind_output_argmax() -> tuple[Callable[[Any, int], None] | None, Callable[[Any], Any] | None]:
    """llama_set_output_argmax / llama_get_output_argmax where the loaded libllama has them
    (patches/llama-output-argmax.patch), else None."""
    import llama_cpp.llama_cpp as raw

    lib = raw._lib
    try:
        set_fn, get_fn = lib.llama_set_output_argmax, lib.llama_get_output_argmax
    except AttributeError:
        return None, None
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p, ctypes.c_int32], None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)
    return set_fn, get_fn


# (ctx, mode) and (ctx) -> the rows' int32 token ids; None without the patch
_set_output_argmax: Callable[[Any, int], None] | None = None
_get_output_argmax: Callable[[Any], Any] | None = None


class LlamaBackend:
    """llama.cpp: reads GGUF."""

    name = "llama"
    formats: tuple[str, ...] = ("gguf",)

    def machine(self) -> MachineInfo:
        """Each GPU's memory as ggml's devices report it, in llama.cpp's device order (that of
        tensor_split and main_gpu), and the host's available memory."""
        L = _llama()
        gpus = [d for d in llama_buft.Ggml().devices() if d["type"] == llama_buft.DEVICE_GPU]
        if not L.llama_supports_gpu_offload():
            gpus = []
        return MachineInfo.of_gpus(
            (GpuInfo(d["name"], d["free"], d["total"]) for d in gpus), host_free_bytes=MachineInfo.host_available()
        )

    def load(self, path: str, options: LoadOptions, progress: Callable[[float], None]) -> LoadedModel:
        """A model that generates, or one that embeds where its GGUF declares a pooling
        (llama_embed): llama.cpp runs the two in different kinds of context."""
        from kinfer_rpc.default_plugins.llama_embed import LlamaEmbedder, declared_pooling

        pooling, dimensions = declared_pooling(path)
        if pooling is not None:
            return LlamaEmbedder(path, options, progress, pooling, dimensions)
        return LlamaModel(path, options, progress)

    def features(self) -> dict[str, Any]:
        """Whether its llama.cpp can spread a model over RPC servers (options.rpcServers), found
        from the library files, without loading them; and that it embeds (a GGUF that declares a
        pooling loads as an embedding model or reranker: llama_embed)."""
        ok, why = llama_rpc.build_support()
        return {"rpc": ok, **({"rpcUnavailable": why} if not ok else {}), "embeddings": True}


class MtpPolicy:
    """`mtp`: the target model's own multi-token-prediction layers draft (GLM-4.5-style NextN
    blocks, loaded with model/load's draftPolicy "mtp"). One session per load; every step it
    drafts k tokens for all drafting requests, one MTP pass per draft position."""

    name = "mtp"

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        raise RuntimeError("mtp drafts through a session (kinfer_rpc.types.DraftSession)")

    def session(self, target: LoadedModel, backend: Backend, options: LoadOptions) -> MtpSession:
        return MtpSession(target)


class MtpSession:
    def __init__(self, target: LoadedModel) -> None:
        if not isinstance(target, LlamaModel):
            raise ValueError("draftPolicy mtp needs the llama backend (llama.cpp's multi-token-prediction API)")
        if target._mtp is None:
            raise ValueError(
                "draftPolicy mtp needs the model loaded with its multi-token-prediction layers "
                '(model/load with draftPolicy "mtp")'
            )
        self.target: LlamaModel = target

    def propose_many(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        mtp = self.target._mtp
        if mtp is None:
            raise RuntimeError("the model's multi-token-prediction context is closed")
        return mtp.propose_many(requests)

    def close(self) -> None:
        pass  # the MTP context belongs to the model (its mirror follows every pass); it closes with it


@kinfer_rpc.hookimpl
def register_backends(register: Callable[[Backend], None]) -> None:
    register(LlamaBackend())


@kinfer_rpc.hookimpl
def register_draft_policies(register: Callable[[DraftPolicy], None]) -> None:
    register(MtpPolicy())
