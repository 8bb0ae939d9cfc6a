"""Loading llama.cpp's native libraries: the one place kinfer imports `llama_cpp`.

Two things go wrong when a process loads llama.cpp's shared libraries the plain way, and both
are decided here, before `import llama_cpp` loads anything:

- **Two C++ runtimes in one process.** A llama.cpp built with `-static-libstdc++` carries its own
  copy of the C++ runtime. The runtime's locale facet ids and similar objects are GNU "unique"
  symbols, which the dynamic linker binds process-wide to the first definition it saw. Once
  numpy, torch or any C++ extension has loaded the system's `libstdc++.so.6`, the private copy
  inside llama.cpp binds to that one's objects while keeping its own code and counters: llama.cpp
  then crashes (seen: a segmentation fault inside `llama_model_load_from_file` on a CUDA build,
  every time `import numpy` came first). A library with a private runtime is refused with an
  error that says so, unless it is loaded before any `libstdc++.so.6`. llama-cpp-python's own
  builds (`pip install llama-cpp-python`, with or without CUDA) link the shared runtime and are
  not affected.
- **A libllama beside the wrong ggml.** `LLAMA_CPP_LIB_PATH` names the folder of the libllama to
  load, but its ggml libraries would be found through `LD_LIBRARY_PATH` first, so a patched
  libllama could silently run on another build's ggml. The ggml libraries in that folder are
  loaded from it, by path, first.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import mmap
import os
import struct
import sys
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_pinned: list[ctypes.CDLL] = []  # kept open: unloading them under llama.cpp would crash it
# Defined only where a library carries (a part of) the C++ runtime inside itself: the exception
# ABI (libsupc++), std::locale::classic(), std::cout.
_RUNTIME_SYMBOLS = frozenset({b"__gxx_personality_v0", b"__cxa_throw", b"_ZNSt6locale7classicEv", b"_ZSt4cout"})


class NativeLoadError(RuntimeError):
    """llama.cpp's libraries cannot be loaded safely into this process."""


def lib_dir() -> Path | None:
    """The folder whose libllama `import llama_cpp` loads: `LLAMA_CPP_LIB_PATH`, else kinfer's
    own build (`kinfer setup`: $KINFER_HOME/llama/lib) where there is one, else the wheel's."""
    env = os.environ.get("LLAMA_CPP_LIB_PATH")
    if env:
        return Path(env)
    own = setup_dir()
    if (own / "libllama.so").is_file():
        return own
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


_exported: str | None = None  # LLAMA_CPP_LIB_PATH as load() set it for kinfer setup's folder


def lib_source() -> str:
    """Where lib_dir() comes from: "LLAMA_CPP_LIB_PATH" (the environment named it), "kinfer setup"
    (its folder) or "the llama-cpp-python wheel"."""
    named = os.environ.get("LLAMA_CPP_LIB_PATH")
    if named and named != _exported:
        return "LLAMA_CPP_LIB_PATH"
    return "kinfer setup" if lib_dir() == setup_dir() else "the llama-cpp-python wheel"


def setup_dir() -> Path:
    """Where `kinfer setup` builds kinfer's llama.cpp."""
    home = os.environ.get("KINFER_HOME") or str(Path.home() / ".kinfer")  # as kinfer_rpc.types.kinfer_home
    return Path(home) / "llama" / "lib"


@functools.cache  # a load reads each library for its needs, then for its symbols: once
def _elf_dynamic(path: Path) -> tuple[list[str], set[bytes]]:
    """(DT_NEEDED names, names of the symbols it defines) of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return [], set()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed: list[str] = []
    defined: set[bytes] = set()

    def cstr(table: int, offset: int) -> bytes:
        start = sections[table][4] + offset
        return data[start : data.index(b"\0", start)]

    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind == 6:  # SHT_DYNAMIC
            for i in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, offset + i)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(link, val).decode())
        elif kind == 11:  # SHT_DYNSYM
            for i in range(entsize, size, entsize):
                st_name, _st_info, _other, st_shndx = struct.unpack_from("<IBBH", data, offset + i)
                if st_shndx != 0:
                    defined.add(cstr(link, st_name))
    return needed, defined


def private_cxx_runtime(path: Path) -> bool:
    """Whether the library carries its own copy of the C++ runtime (linked with -static-libstdc++)."""
    return not _RUNTIME_SYMBOLS.isdisjoint(_elf_dynamic(path)[1])


def loaded_cxx_runtime() -> str | None:
    """The path of the shared C++ runtime this process has already loaded, if any (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rstrip().rsplit(" ", 1)[-1]
                if "/libstdc++.so" in name:
                    return name
    except OSError:
        pass
    return None


def _libraries(folder: Path) -> list[Path]:
    """libllama and the ggml libraries it needs that live in `folder`, dependencies first."""
    order: list[Path] = []

    def visit(name: str) -> None:
        path = folder / name
        if not path.exists() or path in order:
            return
        for dep in _elf_dynamic(path.resolve())[0]:
            visit(dep)
        order.append(path)

    visit("libllama.so")
    return order


def check(folder: Path | None = None) -> list[Path]:
    """Raise NativeLoadError if loading llama.cpp from `folder` (default: lib_dir()) now would
    put two C++ runtimes in this process; return the libraries it would load."""
    folder = folder or lib_dir()
    if folder is None or sys.platform != "linux":
        return []
    libs = _libraries(folder)
    private = [p for p in libs if private_cxx_runtime(p.resolve())]
    runtime = loaded_cxx_runtime() if private else None
    if private and runtime:
        raise NativeLoadError(
            f"llama.cpp in {folder} carries its own copy of the C++ runtime "
            f"({', '.join(p.name for p in private)} linked with -static-libstdc++), "
            f"and this process has already loaded {runtime} (numpy, torch and "
            f"other C++ extensions load it). Two C++ runtimes in one process crash llama.cpp. Use a "
            f"llama.cpp linked with the shared libstdc++ (llama-cpp-python's own build, or "
            f"patches/build_llama.sh), or load llama.cpp before anything that loads libstdc++.so.6."
        )
    return libs


# The switch of kinfer's batch-invariant CUDA kernels (patches/llama-cuda-batch-invariant.patch):
# unset or a non-zero number, on; 0, llama.cpp's own kernels. ggml-cuda reads it once per process.
CUDA_SWITCH = "GGML_CUDA_BATCH_INVARIANT"


@functools.cache
def cuda_batch_invariant(folder: Path | None = None) -> bool | None:
    """Whether llama.cpp's CUDA library in `folder` (default: lib_dir()) has kinfer's
    batch-invariant kernels, whose switch it names; None when there is no CUDA library there."""
    folder = folder or lib_dir()
    libs = sorted(folder.glob("libggml-cuda.so*")) if folder is not None else []
    if not libs:
        return None
    try:
        with open(libs[0], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(CUDA_SWITCH.encode() + b"\0") >= 0
    except (OSError, ValueError):
        return None


def load() -> ModuleType:
    """Check, pin llama.cpp's libraries from their folder, then `import llama_cpp` and return it."""
    with _lock:
        if "llama_cpp" not in sys.modules:
            folder = lib_dir()
            if folder is not None and "LLAMA_CPP_LIB_PATH" not in os.environ and folder == setup_dir():
                os.environ["LLAMA_CPP_LIB_PATH"] = str(folder)  # where llama_cpp itself loads from
                global _exported
                _exported = str(folder)
            for path in check():
                _pinned.append(ctypes.CDLL(str(path)))
    import llama_cpp

    return llama_cpp


def main(argv: list[str]) -> int:
    """`python native.py DIR`: list DIR's llama.cpp libraries; exit 1 if any carries
    its own C++ runtime (build_llama.sh runs it on what it built)."""
    folder = Path(argv[1] if len(argv) > 1 else lib_dir() or ".")
    libs = _libraries(folder)
    private = [p.name for p in libs if private_cxx_runtime(p.resolve())]
    print(f"{folder}: {', '.join(p.name for p in libs) or 'no libllama.so'}")
    if private:
        print(
            f"these carry their own C++ runtime (linked with -static-libstdc++): {', '.join(private)}; "
            "build with a compiler that links the shared libstdc++",
            file=sys.stderr,
        )
        return 1
    return 0 if libs else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
