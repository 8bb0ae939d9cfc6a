"""Embedding and reranking models on the `llama` backend: a GGUF that declares a pooling
(`{arch}.pooling_type`: mean, cls, last, or rank for a reranker) loads into a llama.cpp context in
embeddings mode, which gives one pooled vector (or a reranker's scores) per sequence, and no logits.

Each input runs in a pass of its own (one sequence, its whole token list in one physical batch, as
llama.cpp's encoder requires anyway): the pass's shape, and so every kernel llama.cpp picks and the
order every sum is taken in, depends on that input alone. That is what makes a vector the same
bit for bit whether it is embedded alone, in a list, or while other requests embed theirs.
Pooling is llama.cpp's own, in the same graph.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kinfer_rpc.default_plugins.llama import buft, library
from kinfer_rpc.default_plugins.llama.batch import Batch
from kinfer_rpc.default_plugins.llama.vocab import LlamaVocab
from kinfer_rpc.types import LoadOptions, ModelInfo, SeqChunk

# llama.cpp's enum llama_pooling_type, as {arch}.pooling_type stores it (0: none, a generating model)
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# The sizes a model's vectors may be cut to (Matryoshka representation learning): GGUF has no key
# of its own for it, so kinfer reads this one (an array of integers) where a model's file has it.
DIMENSIONS_KEY = "kinfer.embedding.dimensions"
_GGUF_UINT32, _GGUF_INT32, _GGUF_ARRAY = 4, 5, 9


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def declared_pooling(path: str) -> tuple[str | None, tuple[int, ...]]:
    """The pooling a GGUF file declares (None: none, a model that generates) and the vector sizes
    it may be cut to, from its header alone (ggml's gguf reader: no weights read)."""
    library.load()  # loads the ggml libraries
    g = buft.Ggml()
    fn = g._fn
    init = fn("gguf_init_from_file", [ctypes.c_char_p, _GgufInitParams], ctypes.c_void_p)
    find = fn("gguf_find_key", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_int64)
    kv_type = fn("gguf_get_kv_type", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int)
    arr_type = fn("gguf_get_arr_type", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int)
    get_u32 = fn("gguf_get_val_u32", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_uint32)
    get_i32 = fn("gguf_get_val_i32", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int32)
    get_str = fn("gguf_get_val_str", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_char_p)
    arr_n = fn("gguf_get_arr_n", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_size_t)
    arr_data = fn("gguf_get_arr_data", [ctypes.c_void_p, ctypes.c_int64], ctypes.c_void_p)
    free = fn("gguf_free", [ctypes.c_void_p], None)
    if None in (init, find, kv_type, arr_type, get_u32, get_i32, get_str, arr_n, arr_data, free):
        return None, ()  # a ggml without its gguf reader: every model generates, as before
    ctx = init(os.fsencode(path), _GgufInitParams(True, None))
    if not ctx:
        return None, ()  # not a GGUF llama.cpp reads: its load says why
    try:
        arch_id = find(ctx, b"general.architecture")
        if arch_id < 0:
            return None, ()
        arch = get_str(ctx, arch_id).decode("utf-8", "replace")
        key = find(ctx, f"{arch}.pooling_type".encode())
        value = 0
        if key >= 0 and kv_type(ctx, key) in (_GGUF_UINT32, _GGUF_INT32):
            value = get_u32(ctx, key) if kv_type(ctx, key) == _GGUF_UINT32 else get_i32(ctx, key)
        dims: tuple[int, ...] = ()
        key = find(ctx, DIMENSIONS_KEY.encode())
        if key >= 0 and kv_type(ctx, key) == _GGUF_ARRAY and arr_type(ctx, key) in (_GGUF_UINT32, _GGUF_INT32):
            n = arr_n(ctx, key)
            raw = (ctypes.c_int32 * n).from_address(arr_data(ctx, key)) if n else []
            dims = tuple(sorted({int(d) for d in raw if int(d) > 0}))
        return POOLING_TYPES.get(int(value)), dims
    finally:
        free(ctx)


class LlamaEmbedder(LlamaVocab):
    """A GGUF embedding or reranking model in a llama.cpp context in embeddings mode (the
    LoadedModel contract, with Embeds, Reranks and Reproducible; it does not generate)."""

    def __init__(
        self,
        path: str,
        options: LoadOptions,
        progress: Callable[[float], None],
        pooling: str,
        dimensions: tuple[int, ...] = (),
    ) -> None:
        for asked, what in (
            (options.rpc_servers, "rpcServers"),
            (options.mtp or options.draft_model, "a draft policy"),
        ):
            if asked:
                raise ValueError(f"{what} does not apply to an embedding model, which only embeds")
        L = self.L = library.load()
        self.pooling = pooling
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = options.gpu_layers if options.gpu_layers >= 0 else 999

        def on_progress(fraction: float, _user: Any) -> bool:
            progress(float(fraction))
            return True

        self._progress_cb = L.llama_progress_callback(on_progress)
        mparams.progress_callback = self._progress_cb
        self.ctx: Any = None
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path!r} (not a GGUF file it can read?)")
        self.vocab = L.llama_model_get_vocab(self.model)
        self._pieces: dict[int, bytes] = {}
        n_embd = int(L.llama_model_n_embd_out(self.model) if hasattr(L, "llama_model_n_embd_out") else 0)
        n_embd = n_embd or int(L.llama_model_n_embd(self.model))
        self.width = int(L.llama_model_n_cls_out(self.model)) if pooling == "rank" else n_embd
        cuts = {d for d in dimensions if d <= n_embd}
        self.dimensions = tuple(sorted(cuts | {n_embd})) if cuts and pooling != "rank" else ()
        # A model's positions end at its trained context (BERT's position embeddings stop there).
        train = int(L.llama_model_n_ctx_train(self.model))
        context = min(options.context_length, train) if train > 0 else options.context_length
        cparams = L.llama_context_default_params()
        cparams.n_seq_max = 1
        cparams.n_ctx = context
        # One input is one pass: llama.cpp's encoder takes a batch in one physical batch only.
        cparams.n_batch = cparams.n_ubatch = context
        threads = options.threads or max(1, os.cpu_count() or 1)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.embeddings = True
        cparams.pooling_type = L.LLAMA_POOLING_TYPE_UNSPECIFIED  # the model's own
        cparams.flash_attn_type = (
            L.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attention else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise RuntimeError(f"llama.cpp could not create an embeddings context of {context} tokens")
        self.mem = L.llama_get_memory(self.ctx)  # None for an encoder (BERT): nothing is cached
        self._batch = Batch(L, context)
        self.on_cpu = options.gpu_layers == 0 or not L.llama_supports_gpu_offload()
        bos = L.llama_vocab_bos(self.vocab)
        self.info = ModelInfo(
            name=os.path.basename(path),
            path=path,
            backend="llama",
            n_vocab=int(L.llama_vocab_n_tokens(self.vocab)),
            context_length=int(L.llama_n_ctx(self.ctx)),
            slots=1,
            architecture=self.meta("general.architecture") or "",
            parameters=int(L.llama_model_n_params(self.model)),
            size_bytes=int(L.llama_model_size(self.model)),
            context_train=train,
            description=self._desc(),
            bos_text=self._special_text(bos),
            add_bos=bool(L.llama_vocab_get_add_bos(self.vocab)),
        )

    # -- Embeds, Reranks -----------------------------------------------------------------------
    def embed(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """One pass per list (see the module's docstring): its pooled vector, or its scores."""
        L = self.L
        out = np.empty((len(token_lists), self.width), dtype=np.float32)
        for i, tokens in enumerate(token_lists):
            if not 0 < len(tokens) <= self._batch.capacity:
                raise ValueError(f"an input of {len(tokens)} tokens; this model takes 1 to {self._batch.capacity}")
            if self.mem:  # a decoder's cells from the input before
                L.llama_memory_clear(self.mem, True)
            self._batch.fill([SeqChunk(seq=0, pos=0, tokens=tokens, outputs=len(tokens))])
            rc = L.llama_decode(self.ctx, self._batch.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            ptr = L.llama_get_embeddings_seq(self.ctx, 0)
            if not ptr:
                raise RuntimeError("llama.cpp returned no pooled embedding")
            out[i] = np.ctypeslib.as_array(ptr, shape=(self.width,))
        return out

    def pair_tokens(self, query: str, document: str) -> list[int]:
        """A reranker's input for one pair, as llama.cpp's server builds it: the model's rerank
        template (`{query}`, `{document}`) where it has one, else [BOS] query [EOS] [SEP]
        document [EOS], each special token where the vocabulary adds it."""
        L, vocab = self.L, self.vocab
        template = L.llama_model_chat_template(self.model, b"rerank")
        if template:
            prompt = template.decode("utf-8").replace("{query}", query).replace("{document}", document)
            return self.tokenize(prompt, False, True)
        eos = L.llama_vocab_eos(vocab)
        if eos < 0:
            eos = L.llama_vocab_sep(vocab)
        out: list[int] = []
        if L.llama_vocab_get_add_bos(vocab):
            out.append(L.llama_vocab_bos(vocab))
        out += self.tokenize(query, False, False)
        if L.llama_vocab_get_add_eos(vocab):
            out.append(eos)
        if L.llama_vocab_get_add_sep(vocab):
            out.append(L.llama_vocab_sep(vocab))
        out += self.tokenize(document, False, False)
        if L.llama_vocab_get_add_eos(vocab):
            out.append(eos)
        return out

    def reproducible(self) -> tuple[bool, str]:
        return True, "each input is embedded in a llama.cpp pass of its own, so its vector depends on it alone"

    # -- LoadedModel: an embedding model generates nothing -------------------------------------
    def chat_template(self) -> str | None:
        return None

    def eog_tokens(self) -> Iterable[int]:
        return ()

    def decode(self, chunks: Sequence[SeqChunk]) -> Callable[[], np.ndarray]:
        raise RuntimeError(f"{self.info.name} is an embedding model (pooling {self.pooling}): it does not generate")

    def seq_remove(self, seq: int, start: int = 0, end: int = -1) -> None:
        """Nothing is kept between passes (each input clears the cells it used)."""

    def seq_copy(self, src: int, dst: int, start: int = 0, end: int = -1) -> None:
        """Nothing is kept between passes."""

    def memory(self) -> dict[str, Any]:
        return {
            "modelBytes": self.info.size_bytes,
            "contextCells": int(self.L.llama_n_ctx(self.ctx)) if self.ctx else 0,
            "pooling": self.pooling,
            "device": "cpu" if self.on_cpu else "gpu",
        }

    def close(self) -> None:
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None
