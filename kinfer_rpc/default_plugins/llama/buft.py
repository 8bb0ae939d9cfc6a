"""Patch: bind `llama_model_params.tensor_buft_overrides` in llama-cpp-python 0.3.36.

Why: llama.cpp keeps any tensor whose name matches a pattern in the buffer type given with it
(`llama_model_params.tensor_buft_overrides`, a NULL-terminated array of
`struct llama_model_tensor_buft_override { const char *pattern; ggml_backend_buffer_type_t buft; }`).
That is how a mixture-of-experts model keeps its expert tensors in host memory while the rest
runs on the GPU (llama.cpp's `--cpu-moe` / `-ot exps=CPU`). llama-cpp-python 0.3.36 declares the
field as a plain `c_void_p` marked "NOTE: unused", defines no struct for its elements and binds no
way to get a buffer type, so the feature is out of reach from Python.

What: `apply(llama_cpp)` defines the element struct, a `llama_model_params` whose field is typed
as a pointer to it (every other field the same, checked offset by offset against upstream's), and
re-declares every bound function that takes or returns `llama_model_params` with it. `Ggml` finds
`ggml_backend_cpu_buffer_type()` and the device queries in the ggml libraries the process has
already loaded (llama.cpp compares the CPU buffer type by address, so it must be the very same
library's), and `overrides()` builds the array.

How to drop it: once llama-cpp-python types the field as a pointer to a struct, `apply()` leaves
its bindings alone and only adds what is missing (the test in tests/test_placement.py shows
which path ran). Then delete this module and use upstream's names in kinfer_rpc/default_plugins/llama.py.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any


class llama_model_tensor_buft_override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_applied: dict[int, type[ctypes.Structure]] = {}


def apply(L: Any) -> type[ctypes.Structure]:  # L: the llama_cpp module, patched in place
    """Make `L.llama_model_params.tensor_buft_overrides` a typed pointer; return the params class.

    Idempotent. Raises RuntimeError if upstream's struct no longer has the layout this patch
    knows (then the patch must be revisited rather than guessed)."""
    key = id(L)
    if key in _applied:
        return _applied[key]
    old: type[ctypes.Structure] = L.llama_model_params
    fields = list(old._fields_)
    names = [f[0] for f in fields]
    if "tensor_buft_overrides" not in names:
        raise RuntimeError(
            "llama_model_params has no tensor_buft_overrides field: revisit kinfer_rpc/default_plugins/llama/buft.py"
        )
    i = names.index("tensor_buft_overrides")
    if fields[i][1] is not ctypes.c_void_p:
        # Upstream binds it: nothing to patch.
        _applied[key] = old
        return old
    fields[i] = ("tensor_buft_overrides", ctypes.POINTER(llama_model_tensor_buft_override))
    new = type("llama_model_params", (ctypes.Structure,), {"_fields_": fields, "__doc__": old.__doc__})
    if ctypes.sizeof(new) != ctypes.sizeof(old) or any(getattr(new, n).offset != getattr(old, n).offset for n in names):
        raise RuntimeError("the patched llama_model_params does not match upstream's layout")
    # Every bound C function that takes or returns the struct by value now uses the new class.
    for name in dir(L):
        fn = getattr(L, name)
        # typeshed imports _CFuncPtr into ctypes without re-exporting it; it is there at runtime
        if not isinstance(fn, ctypes._CFuncPtr):  # type: ignore[attr-defined]
            continue
        if getattr(fn, "restype", None) is old:
            fn.restype = new
        args = getattr(fn, "argtypes", None)
        if args and old in args:
            fn.argtypes = [new if a is old else a for a in args]
    L.llama_model_params = new
    L.llama_model_tensor_buft_override = llama_model_tensor_buft_override
    _applied[key] = new
    return new


def _loaded_libraries() -> list[str]:
    """Paths of the shared libraries this process has mapped (Linux), else the library folders."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split(None, 5)[5].strip() for line in fh if line.count(" ") >= 5 and "/" in line}
        return sorted(p for p in paths if "ggml" in os.path.basename(p))
    except (OSError, IndexError):
        pass
    dirs = [os.environ.get("LLAMA_CPP_LIB_PATH")]
    try:
        import llama_cpp

        dirs.append(str(Path(llama_cpp.__file__).parent / "lib"))
    except ImportError:
        pass
    ext = ".dylib" if sys.platform == "darwin" else ".so"
    return [str(p) for d in dirs if d for p in sorted(Path(d).glob(f"libggml*{ext}"))]


class _DevProps(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", ctypes.c_bool * 5),
    ]


DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2


class Ggml:
    """The ggml functions llama-cpp-python does not bind, from the libraries already loaded.

    Construct it after `import llama_cpp` (which loads them)."""

    def __init__(self) -> None:
        self._libs: list[ctypes.CDLL] = []
        for path in _loaded_libraries():
            try:
                self._libs.append(ctypes.CDLL(path))
            except OSError:
                continue
        self.cpu_buffer_type = self._fn("ggml_backend_cpu_buffer_type", [], ctypes.c_void_p)
        self.dev_count = self._fn("ggml_backend_dev_count", [], ctypes.c_size_t)
        self.dev_get = self._fn("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p)
        self.dev_type = self._fn("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)
        self.dev_name = self._fn("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p)
        self.dev_description = self._fn("ggml_backend_dev_description", [ctypes.c_void_p], ctypes.c_char_p)
        self.dev_memory = self._fn(
            "ggml_backend_dev_memory",
            [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
            None,
        )
        self.buft_name = self._fn("ggml_backend_buft_name", [ctypes.c_void_p], ctypes.c_char_p)
        self.dev_reg = self._fn("ggml_backend_dev_backend_reg", [ctypes.c_void_p], ctypes.c_void_p)
        self.reg_proc = self._fn(
            "ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
        )

    def row_split(self, index: int) -> bool:
        """Whether ggml device `index`'s backend has split buffers (`ggml_backend_split_buffer_type`),
        which llama.cpp's split mode row needs for every GPU it uses."""
        if None in (self.dev_get, self.dev_reg, self.reg_proc):
            return False
        reg = self.dev_reg(self.dev_get(index))
        return bool(reg) and bool(self.reg_proc(reg, b"ggml_backend_split_buffer_type"))

    def _fn(self, name: str, argtypes: list[type[Any]], restype: type[Any] | None) -> Any:
        """The named C function (a ctypes function pointer) of the first library that has it, else None."""
        for lib in self._libs:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
                return fn
        return None

    def cpu_buft(self) -> int:
        if self.cpu_buffer_type is None:
            raise RuntimeError("ggml_backend_cpu_buffer_type was not found in the loaded ggml libraries")
        buft: int | None = self.cpu_buffer_type()  # c_void_p: an int, or None for NULL
        if not buft:
            raise RuntimeError("ggml_backend_cpu_buffer_type() returned NULL")
        return buft

    def devices(self) -> list[dict[str, Any]]:
        """Every ggml device: name, description, type (0 CPU, 1 GPU, 2 integrated GPU, ...), free and
        total bytes."""
        if None in (self.dev_count, self.dev_get, self.dev_type, self.dev_memory):
            return []
        out = []
        for i in range(self.dev_count()):
            dev = self.dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            name = self.dev_name(dev) if self.dev_name else b""
            description = self.dev_description(dev) if self.dev_description else b""
            out.append(
                {
                    "name": (name or b"").decode("utf-8", "replace"),
                    "description": (description or b"").decode("utf-8", "replace"),
                    "type": int(self.dev_type(dev)),
                    "free": int(free.value),
                    "total": int(total.value),
                }
            )
        return out


class Overrides:
    """A NULL-terminated `llama_model_tensor_buft_override` array, with its strings kept alive."""

    def __init__(self, L: ModuleType, patterns: Iterable[str], buft: int) -> None:
        self.cls: type[ctypes.Structure] = getattr(
            L, "llama_model_tensor_buft_override", llama_model_tensor_buft_override
        )
        self.patterns = [p.encode() for p in patterns]
        self.array = (self.cls * (len(self.patterns) + 1))()
        for i, p in enumerate(self.patterns):
            self.array[i].pattern = p
            self.array[i].buft = buft
        self.array[len(self.patterns)].pattern = None
        self.array[len(self.patterns)].buft = None

    @property
    def pointer(self) -> ctypes._Pointer[ctypes.Structure]:
        return ctypes.cast(self.array, ctypes.POINTER(self.cls))
