"""Images in prompts, through llama.cpp's multimodal library (libmtmd) and a model's projector.

libmtmd is loaded from the folder of the libllama kinfer loads (native.lib_dir(): kinfer's own
build has it since patches/build_llama.sh builds it, as the llama-cpp-python wheel does): a
libmtmd of another build would run on another libllama. An image is read (PNG, JPEG, BMP, GIF:
stb_image) and cut into the projector's tokens when the host tokenizes the prompt; its
embeddings are computed on the engine thread when the request's prompt reaches it, and kept by
the hash of the image's bytes (an LRU of IMAGES images, at most CACHE_BYTES), so a client that
sends the same image again (an agent's screenshot, each turn) pays for its encoding once.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kinfer_rpc.default_plugins.llama import library, native
from kinfer_rpc.types import Media

IMAGES = 64  # embeddings of this many distinct images kept per load, least recently used out first
CACHE_BYTES = 256 << 20  # ... and at most this many bytes of them
_NAMES = ("libmtmd.so", "libmtmd.dylib", "mtmd.dll")
_lock = threading.Lock()
_module: ModuleType | None = None


def library_dir() -> Path | None:
    """The folder whose libmtmd kinfer loads (MTMD_CPP_LIB where set, else the libllama's)."""
    named = os.environ.get("MTMD_CPP_LIB")
    return Path(named) if named else native.lib_dir()


def available() -> tuple[bool, str]:
    """Whether libmtmd is there beside the libllama kinfer loads, and why not: without loading it."""
    folder = library_dir()
    if folder is not None and any((folder / n).is_file() for n in _NAMES):
        return True, ""
    where = f"in {folder}" if folder is not None else "beside llama.cpp's libraries"
    return False, (
        f"llama.cpp's multimodal library (libmtmd) is not {where}: patches/build_llama.sh (kinfer setup) "
        "builds it beside libllama"
    )


def mtmd() -> ModuleType:
    """llama-cpp-python's bindings of libmtmd, loaded once from library_dir(); RuntimeError
    where there is no libmtmd there."""
    global _module
    library.load()
    with _lock:
        if _module is None:
            ok, why = available()
            if not ok:
                raise RuntimeError(why)
            folder = library_dir()
            assert folder is not None, "available() found the folder"
            lib = next(folder / n for n in _NAMES if (folder / n).is_file())
            if sys.platform == "linux" and native.private_cxx_runtime(lib.resolve()) and native.loaded_cxx_runtime():
                # as native.check refuses such a libllama: two C++ runtimes in one process crash
                raise RuntimeError(
                    f"{lib} carries its own copy of the C++ runtime (linked with -static-libstdc++) and this process "
                    "has loaded the shared one: use a libmtmd built by patches/build_llama.sh (kinfer setup)"
                )
            os.environ.setdefault("MTMD_CPP_LIB", str(folder))  # what llama_cpp.mtmd_cpp loads from
            import llama_cpp.mtmd_cpp as M

            # its log (the projector's load, each image) goes where llama.cpp's goes: Python's log
            if library._log_callback is not None:
                M.mtmd_helper_log_set(library._log_callback, None)
            _module = M
        return _module


MAX_PIXELS = 50_000_000  # the largest image read (its pixels are decoded whole before any resize)


def dimensions(data: bytes) -> tuple[int, int] | None:
    """An image file's width and height from its header (PNG, GIF, BMP, JPEG), None where the
    header says nothing this reads: checked before llama.cpp decodes the file, so a small file
    that unpacks into gigabytes of pixels is refused first."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data[:2] == b"BM" and len(data) >= 26:
        return abs(int.from_bytes(data[18:22], "little", signed=True)), abs(
            int.from_bytes(data[22:26], "little", signed=True)
        )
    if data[:2] == b"\xff\xd8":  # JPEG: the first start-of-frame marker has the size
        i = 2
        while i + 9 <= len(data) and data[i] == 0xFF:
            marker = data[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


class _Chunk:
    """An image's tokenized chunk (mtmd_input_chunk), freed with its last reference."""

    def __init__(self, M: ModuleType, ptr: Any) -> None:
        self.ptr = ptr
        weakref.finalize(self, M.mtmd_input_chunk_free, ptr)


class Projector:
    """A model's projector (mtmd_context) beside its llama.cpp context, and its image cache."""

    def __init__(
        self,
        L: ModuleType,
        model: Any,
        path: str,
        *,
        threads: int,
        use_gpu: bool,
        tokenize: Callable[[str, bool, bool], list[int]],
    ) -> None:
        M = self.M = mtmd()
        self.L = L
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = threads
        params.print_timings = False
        self.ctx = M.mtmd_init_from_file(path.encode(), model, params)
        if not self.ctx:
            raise RuntimeError(
                f"llama.cpp could not load the projector {path!r} for this model (not an mmproj GGUF of it? "
                "the log says why)"
            )
        if not M.mtmd_support_vision(self.ctx):
            M.mtmd_free(self.ctx)
            self.ctx = None
            raise RuntimeError(f"the projector {path!r} reads no images (an audio projector?)")
        self.marker = M.mtmd_default_marker()
        embd_inp = getattr(L, "llama_model_n_embd_inp", None)
        self.n_embd = int(embd_inp(model) if embd_inp is not None else L.llama_model_n_embd(model))
        self._tokenize = tokenize
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.encoded = 0  # images whose embeddings the encoder computed
        self.cached = 0  # images whose embeddings came from the cache

    def prompt(self, pieces: Sequence[str | bytes], add_special: bool) -> tuple[list[int], list[Media]]:
        """The prompt's tokens, with placeholders (token 0) where its images' embeddings go, and
        each image's Media."""
        ids: list[int] = []
        media: list[Media] = []
        for i, piece in enumerate(pieces):
            if isinstance(piece, str):
                if piece or (i == 0 and add_special):
                    ids += self._tokenize(piece, add_special and i == 0, True)
            else:
                self._image(piece, ids, media)
        return ids, media

    def _image(self, data: bytes, ids: list[int], media: list[Media]) -> None:
        M = self.M
        size = dimensions(data)
        if size is not None and size[0] * size[1] > MAX_PIXELS:
            raise ValueError(f"the image is {size[0]}x{size[1]} pixels, more than {MAX_PIXELS:,} (scale it down)")
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False, None)
        if not bitmap:
            raise ValueError("not an image llama.cpp can read (PNG, JPEG, BMP, GIF, ...)")
        key = hashlib.sha256(data).hexdigest()
        chunks = M.mtmd_input_chunks_init()
        try:
            M.mtmd_bitmap_set_id(bitmap, key.encode())
            text = M.mtmd_input_text()
            text.text = self.marker
            text.text_len = len(self.marker)
            text.add_special = False
            text.parse_special = True
            bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise ValueError(f"llama.cpp could not prepare the image for the projector (mtmd_tokenize: {rc})")
            for j in range(M.mtmd_input_chunks_size(chunks)):
                chunk = M.mtmd_input_chunks_get(chunks, j)
                kind = M.mtmd_input_chunk_get_type(chunk)
                if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    ids += [ptr[k] for k in range(n.value)]
                elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    length = int(M.mtmd_input_chunk_get_n_pos(chunk))
                    handle = _Chunk(M, M.mtmd_input_chunk_copy(chunk))
                    media.append(Media(start=len(ids), length=length, key=f"{key}:{j}", handle=handle))
                    ids += [0] * length
                else:
                    raise ValueError("the projector made something other than image tokens of an image")
        finally:
            M.mtmd_input_chunks_free(chunks)
            M.mtmd_bitmap_free(bitmap)

    def eval(self, lctx: Any, seq: int, media: Media, pos: int, n_batch: int) -> None:
        """The image's embeddings (from the cache, else the encoder) into `seq`'s cells at `pos`."""
        M = self.M
        chunk = media.handle.ptr
        with self._cache_lock:
            embd = self._cache.get(media.key)
            if embd is not None:
                self._cache.move_to_end(media.key)
        if embd is None:
            rc = M.mtmd_encode_chunk(self.ctx, chunk)
            if rc != 0:
                raise RuntimeError(f"llama.cpp could not encode the image (mtmd_encode_chunk: {rc})")
            n_tokens = int(M.mtmd_input_chunk_get_n_tokens(chunk))
            out = M.mtmd_get_output_embd(self.ctx)
            embd = np.ctypeslib.as_array(out, shape=(n_tokens * self.n_embd,)).copy()
            with self._cache_lock:
                self.encoded += 1
                self._cache[media.key] = embd
                while len(self._cache) > IMAGES or (
                    len(self._cache) > 1 and sum(e.nbytes for e in self._cache.values()) > CACHE_BYTES
                ):
                    self._cache.popitem(last=False)
        else:
            with self._cache_lock:
                self.cached += 1
        new_pos = ctypes.c_int32(0)
        rc = M.mtmd_helper_decode_image_chunk(
            self.ctx,
            lctx,
            chunk,
            embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos,
            seq,
            n_batch,
            ctypes.byref(new_pos),
            M.mtmd_helper_post_decode_callback(),
            None,
        )
        if rc != 0:
            raise RuntimeError(f"llama.cpp could not decode the image's embeddings (code {rc})")
        if new_pos.value != pos + media.length:
            raise RuntimeError(f"the image took {new_pos.value - pos} positions, not {media.length}")

    def stats(self) -> dict[str, int]:
        with self._cache_lock:
            return {"encoded": self.encoded, "cached": self.cached, "kept": len(self._cache)}

    def close(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None
