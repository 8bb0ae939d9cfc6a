"""`kinfer setup`: kinfer's own llama.cpp, built once into $KINFER_HOME/llama/lib, which kinfer
then loads by default (kinfer_rpc/default_plugins/llama/native.py: LLAMA_CPP_LIB_PATH first,
then this folder, then the llama-cpp-python wheel's).

kinfer's build carries its patches (patches/README.md): on a CUDA GPU, batch-invariant kernels
(the same reply whatever else runs), the argmax taken in the pass, RPC servers that cannot end
the process. With CUDA (`--cuda`, or by default where `nvcc` is found and the NVIDIA driver
shows a GPU) it is built for this machine's GPUs (or the architectures CMAKE_ARGS names);
otherwise for the CPU. The build is patches/build_llama.sh of kinfer's checkout,
which says each step and the compile's progress; it keeps its build folder in
$KINFER_HOME/llama/build, so a second run recompiles only what changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kinfer_rpc.types import kinfer_home

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout kinfer runs from


class SetupError(Exception):
    """Why the build cannot start or did not finish; the message says what to do."""


def lib_folder() -> Path:
    return kinfer_home() / "llama" / "lib"


def build_script() -> Path:
    script = ROOT / "patches" / "build_llama.sh"
    if not script.is_file():
        raise SetupError(
            f"kinfer setup builds from kinfer's source checkout, and {script} is not there: "
            "install kinfer from a clone (pip install -e .) and run it again"
        )
    return script


def nvcc() -> str | None:
    """CUDA's compiler where this machine has one (on PATH, or CUDA's usual folder)."""
    found = shutil.which("nvcc")
    if found:
        return found
    usual = Path("/usr/local/cuda/bin/nvcc")
    return str(usual) if usual.exists() else None


def nvidia_gpu() -> bool:
    """Whether the NVIDIA driver shows a GPU on this machine."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def build(cuda: bool | None, source: str | None = None) -> tuple[Path, bool]:
    """Build kinfer's llama.cpp into lib_folder(); (the folder, whether with CUDA). `cuda` None:
    with CUDA where nvcc is found and the driver shows a GPU. The build's own steps and progress
    go to stderr."""
    script = build_script()
    compiler = nvcc()
    gpu = nvidia_gpu()
    if cuda is None:
        cuda = compiler is not None and gpu
    if cuda and compiler is None:
        raise SetupError("--cuda needs CUDA's compiler (nvcc), which is not on PATH nor in /usr/local/cuda/bin")
    cmake_args = os.environ.get("CMAKE_ARGS", "")
    arches = "-DCMAKE_CUDA_ARCHITECTURES" in cmake_args
    if cuda and not gpu and not arches:
        raise SetupError(
            "no NVIDIA GPU is visible here, so the build cannot target this machine's: name the GPUs' "
            "architectures, e.g. CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90 kinfer setup --cuda (90: H100/H200)"
        )
    if shutil.which("cmake") is None:
        raise SetupError("building llama.cpp needs cmake (pip install cmake, or your system's package)")
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)  # the build checks its libraries with this Python
    env["BUILD_DIR"] = str(kinfer_home() / "llama" / "build")
    if source:
        env["SRC"] = source
    if cuda:
        assert compiler is not None
        env["PATH"] = f"{Path(compiler).parent}{os.pathsep}{env.get('PATH', '')}"
        # the GPUs this machine has (CMake 3.24+), unless CMAKE_ARGS names architectures
        native = "" if arches else "-DCMAKE_CUDA_ARCHITECTURES=native "
        env["CMAKE_ARGS"] = f"-DGGML_CUDA=ON {native}{cmake_args}".strip()
    dest = lib_folder()
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["bash", str(script), str(dest)], env=env, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise SetupError(f"the build failed (exit {done.returncode}); what it said is above")
    return dest, cuda


def check(folder: Path) -> dict[str, object]:
    """Load the built library the way kinfer-rpc will, in a fresh process: what it is."""
    code = (
        "import json, ctypes; from kinfer_rpc.default_plugins.llama import native; "
        "L = native.load(); folder = native.lib_dir(); "
        "lib = ctypes.CDLL(str(folder / 'libllama.so')); "
        "print(json.dumps({'folder': str(folder), 'patched': hasattr(lib, 'llama_set_output_argmax'), "
        "'gpuOffload': bool(L.llama_supports_gpu_offload()), "
        "'batchInvariantCuda': native.cuda_batch_invariant(folder), "
        "'loaded': sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libllama.so' in l})}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SetupError(f"the library was built but does not load: {done.stderr.strip()[-2000:]}")
    import json

    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    loaded = [Path(p).resolve().parent for p in report.pop("loaded")]  # type: ignore[attr-defined]
    if Path(str(report["folder"])).resolve() != folder.resolve() or loaded != [folder.resolve()]:
        raise SetupError(f"kinfer loads {report['folder']} ({loaded}), not the library just built in {folder}")
    return report
