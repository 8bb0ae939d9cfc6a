"""patches/build_llama.sh says what it does while it builds: each step as it starts, and the
compile's percentage (a line every 10% off a terminal), never minutes of silence. Run here with
stand-ins for cmake, the compiler, patch and the library check, on an empty source tree: the
script's own steps, not llama.cpp's build (the README's test command does that for real)."""

from __future__ import annotations

import os
import subprocess

from paths import ROOT

FAKE_CMAKE = r"""#!/usr/bin/env bash
echo "$@" >> "$CMAKE_CALLS"
if [ "$1" = --build ]; then
  mkdir -p "$2/bin"
  for pct in 3 9 14 27 33 48 51 66 72 88 95 100; do
    echo "[ $pct%] Building C object ggml/src/part$pct.c.o"
  done
  echo "[100%] Built target llama"
  touch "$2/bin/libllama.so" "$2/bin/libggml.so"
else
  while [ $# -gt 0 ]; do [ "$1" = -B ] && mkdir -p "$2"; shift; done
  echo "-- Configuring done"
fi
"""
FAKE_CXX = """#!/usr/bin/env bash
while [ $# -gt 0 ]; do [ "$1" = -o ] && touch "$2"; shift; done
"""


def test_build_llama_says_each_step_and_the_progress(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    for name, text in (("cmake", FAKE_CMAKE), ("c++", FAKE_CXX), ("patch", "#!/bin/sh\ncat > /dev/null\n")):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    src = tmp_path / "llama.cpp"
    src.mkdir()
    for part in ("conversion", "gguf-py"):  # the converter the script copies beside the libraries
        (src / part).mkdir()
    (src / "convert_hf_to_gguf.py").write_text("")
    env = {
        **os.environ,
        "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
        "SRC": str(src),
        "CXX": str(tools / "c++"),
        "PYTHON": "true",  # the library check needs real libraries
        "CMAKE_CALLS": str(tmp_path / "cmake-calls"),
    }
    dest = tmp_path / "lib"
    proc = subprocess.run(
        ["bash", str(ROOT / "patches" / "build_llama.sh"), str(dest)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest) and (dest / "libllama.so").exists() and (dest / "ggml-rpc-server").exists()
    said = proc.stderr.splitlines()
    steps = [line.split(": ", 1)[1] for line in said if line.startswith("build_llama.sh [")]
    patches = sorted(p.name for p in (ROOT / "patches").glob("llama-*.patch"))
    assert steps[0].startswith("llama.cpp's source from")
    assert steps[1 : 1 + len(patches)] == [f"applying {p}" for p in patches]
    assert [s.split(" ")[0] for s in steps[1 + len(patches) :]] == [
        "configuring",
        "compiling",
        "compiling",
        "checking",
        "copying",
        "done:",
    ]
    assert (dest.parent / "convert" / "convert_hf_to_gguf.py").exists()
    configure, build = (tmp_path / "cmake-calls").read_text().splitlines()
    # llama.cpp's multimodal library (images) is built beside libllama, without its tools
    assert "-DLLAMA_BUILD_MTMD=ON" in configure.split() and "-DLLAMA_BUILD_TOOLS=OFF" in configure.split()
    assert build.split()[build.split().index("--target") + 1 :][:2] == ["llama", "mtmd"]
    percents = [int(line.split(": ")[1].split("%")[0]) for line in said if line.startswith("  compiling:")]
    assert percents == [3, 14, 27, 33, 48, 51, 66, 72, 88, 95, 100], said  # a line every 10% off a terminal
