"""`kinfer setup` as a person runs it: kinfer's llama.cpp built into $KINFER_HOME/llama/lib, then
loaded by kinfer from there by default. The compile itself is llama.cpp's (tests/test_build_llama.py
checks the script's steps; CI builds it for real): here cmake stands in and "builds" by copying
the libraries this checkout built, so what is checked is kinfer's side: the command, where it
puts them, that a fresh kinfer process loads them (its /proc maps), and what `kinfer doctor` says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import KINFER, env
from paths import ROOT

BUILT = ROOT / ".llama" / "lib"

pytestmark = pytest.mark.skipif(not (BUILT / "libllama.so").exists(), reason="patches/build_llama.sh has not run")

FAKE_CMAKE = rf"""#!/usr/bin/env bash
if [ "$1" = --build ]; then
  mkdir -p "$2/bin"
  echo "[ 50%] Building C object ggml/src/ggml.c.o"
  echo "[100%] Built target llama"
  cp -a {BUILT}/lib*.so* "$2/bin/"
else
  while [ $# -gt 0 ]; do [ "$1" = -B ] && mkdir -p "$2"; shift; done
fi
"""
FAKE_CXX = """#!/usr/bin/env bash
while [ $# -gt 0 ]; do [ "$1" = -o ] && touch "$2"; shift; done
"""


def test_setup_builds_into_kinfer_home_and_kinfer_loads_it(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in (("cmake", FAKE_CMAKE), ("c++", FAKE_CXX), ("patch", "#!/bin/sh\ncat > /dev/null\n")):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    src = tmp_path / "llama.cpp"
    (src / "conversion").mkdir(parents=True)
    (src / "gguf-py").mkdir()
    (src / "convert_hf_to_gguf.py").write_text("")
    home = tmp_path / "home"
    base = {k: v for k, v in env().items() if k != "LLAMA_CPP_LIB_PATH"}
    run_env = {**base, "KINFER_HOME": str(home), "PATH": f"{tools}{os.pathsep}{base['PATH']}"}
    proc = subprocess.run(
        [KINFER, "setup", "--cpu", "--source", str(src), "--json"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    lib = home / "llama" / "lib"
    assert report["folder"] == str(lib) and report["patched"] is True and report["cuda"] is False, report
    assert report["batchInvariantCuda"] is None  # no CUDA library in a CPU build
    assert "compiling: 50%" in proc.stderr or "compiling" in proc.stderr  # the build's progress was shown

    # kinfer doctor names it; a chat through kinfer runs on it
    doctor = json.loads(
        subprocess.run([KINFER, "doctor", "--json"], env=run_env, capture_output=True, text=True, timeout=300).stdout
    )
    assert doctor["libllama"]["from"] == "kinfer setup" and doctor["libllama"]["patched"] is True, doctor["libllama"]
    assert Path(doctor["libllama"]["path"]).parent == lib.resolve()
    said = subprocess.run(
        [KINFER, "run", "smollm2", "Say hi.", "--max-tokens", "3", "--threads", "1"],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert said.returncode == 0 and said.stdout.strip(), said.stderr


def test_setup_without_cmake_says_what_to_install(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("bash", "env"):
        path = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        (bare / tool).symlink_to(path)
    proc = subprocess.run(
        [KINFER, "setup", "--cpu"],
        env={**env(), "KINFER_HOME": str(tmp_path / "home"), "PATH": str(bare)},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1 and "needs cmake" in proc.stderr, proc.stderr
    from kinfer_rpc.terminal import setup

    proc = subprocess.run(
        [KINFER, "setup", "--cuda"],
        env={**env(), "KINFER_HOME": str(tmp_path / "home"), "PATH": str(bare)},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    if setup.nvcc() is None:  # as found with that PATH: CUDA's usual folder
        assert proc.returncode == 1 and "nvcc" in proc.stderr, proc.stderr
    elif not setup.nvidia_gpu():
        assert proc.returncode == 1 and "CMAKE_CUDA_ARCHITECTURES" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 1 and "needs cmake" in proc.stderr, proc.stderr
