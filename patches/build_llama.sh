#!/usr/bin/env bash
# Build llama.cpp exactly as llama-cpp-python 0.3.36 vendors it, with the patches kinfer carries
# against it (patches/llama-*.patch), into DEST (default: .llama/lib of this checkout). kinfer
# loads it when LLAMA_CPP_LIB_PATH names that folder (tests/conftest.py sets it when it exists).
#
#   bash patches/build_llama.sh [DEST]
#
# With ggml's RPC backend (libggml-rpc, and the `ggml-rpc-server` program beside the libraries)
# and llama.cpp's multimodal library (libmtmd: images for models with a vision projector).
# CPU only and portable (AVX2) unless CMAKE_ARGS adds options (bench/gpu_setup.sh builds the CUDA
# libraries with -DGGML_CUDA=ON this way). CC and CXX pick the compiler, as in any CMake build.
# SRC: a llama.cpp source tree or .tgz to use instead of downloading the sdist from PyPI.
# BUILD_DIR: keep the build there, so that building again recompiles only what changed (a tree
# unpacked from a .tgz keeps its files' times; the patched files are rebuilt).
#
# It says each step on stderr as it starts and how long the build has taken; the compile (about
# two minutes on two cores) shows its percentage: on one line at a terminal, a line every 10%
# elsewhere (CI's log). The tools' own output goes to cmake.log and build.log, shown on failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=$(realpath -m "${1:-$here/../.llama/lib}")
started=$SECONDS
step() { printf 'build_llama.sh [%ds]: %s\n' "$((SECONDS - started))" "$*" >&2; }
# The compile's percentage, from make's "[ 42%]" or ninja's "[12/140]" lines on stdin.
progress() {
  local line pct shown=-10 tty=0
  [ -t 2 ] && tty=1
  while IFS= read -r line; do
    if [[ $line =~ ^\[\ *([0-9]+)%\] ]]; then pct=${BASH_REMATCH[1]}
    elif [[ $line =~ ^\[([0-9]+)/([0-9]+)\] ]]; then pct=$((100 * BASH_REMATCH[1] / BASH_REMATCH[2]))
    else continue; fi
    if [ "$tty" = 1 ]; then
      printf '\r  %s: %3d%% (%ds)' "$1" "$pct" "$((SECONDS - started))" >&2
    elif [ "$pct" -ge $((shown + 10)) ]; then
      shown=$((pct / 10 * 10))
      printf '  %s: %d%% (%ds)\n' "$1" "$pct" "$((SECONDS - started))" >&2
    fi
  done
  [ "$tty" = 1 ] && printf '\n' >&2
  return 0
}
if [ -n "${BUILD_DIR:-}" ]; then
  work=$BUILD_DIR
  mkdir -p "$work" && rm -rf "$work/llama.cpp"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
if [ -n "${SRC:-}" ]; then
  step "llama.cpp's source from $SRC"
  if [ -d "$SRC" ]; then cp -r "$SRC" "$work/llama.cpp"; else mkdir "$work/llama.cpp" && tar xzf "$SRC" -C "$work/llama.cpp"; fi
else
  py=${PYTHON:-python3}
  [ -x "$here/../.venv/bin/python" ] && py=${PYTHON:-$here/../.venv/bin/python}
  step "downloading llama-cpp-python 0.3.36's source (it vendors llama.cpp) from PyPI"
  "$py" -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
  tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
  mv "$work"/llama_cpp_python-0.3.36/vendor/llama.cpp "$work/llama.cpp"
fi
for p in "$here"/llama-*.patch; do
  step "applying $(basename "$p")"
  if command -v patch > /dev/null; then patch -d "$work/llama.cpp" -p1 --quiet --forward < "$p"
  else (cd "$work/llama.cpp" && git apply "$p"); fi
done
step "configuring (CMake: shared libraries, CPU with AVX2, the RPC backend, mtmd${CMAKE_ARGS:+, $CMAKE_ARGS})"
cmake -S "$work/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DGGML_RPC=ON -DGGML_RPC_RDMA=OFF \
  -DLLAMA_BUILD_MTMD=ON -DMTMD_VIDEO=OFF \
  ${CMAKE_ARGS:-} > "$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
step "compiling libllama, ggml and libmtmd on $(nproc) cores (about 4 minutes on 2; the log: build.log)"
cmake --build "$work/build" --target llama mtmd -j "$(nproc)" 2>&1 | tee "$work/build.log" | progress compiling ||
  { tail -50 "$work/build.log"; exit 1; }
# ggml's RPC server (llama.cpp's tools/rpc, the `ggml-rpc-server` program): it needs only ggml, so
# it is compiled here against the libraries just built instead of configuring llama.cpp's tools.
step "compiling ggml-rpc-server"
"${CXX:-c++}" -O2 -std=c++17 -I "$work/llama.cpp/ggml/include" "$work/llama.cpp/tools/rpc/rpc-server.cpp" \
  -L "$work/build/bin" -lggml -lggml-base -Wl,-rpath,'$ORIGIN' -o "$work/build/bin/ggml-rpc-server" \
  >> "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
# A compiler that links the C++ runtime statically (-static-libstdc++) makes libraries that crash
# in a process that also loads libstdc++.so.6 (kinfer_rpc/default_plugins/llama/native.py): refuse them here.
step "checking that the libraries link the shared C++ runtime"
"${PYTHON:-python3}" "$here/../kinfer_rpc/default_plugins/llama/native.py" "$work/build/bin" >&2
mkdir -p "$dest"
cp -a "$work"/build/bin/lib*.so* "$work/build/bin/ggml-rpc-server" "$dest"/
# llama.cpp's converter from Hugging Face checkpoints to GGUF, of the same llama.cpp, beside the
# libraries, with the gguf-py it is written against (newer than PyPI's gguf of the same version):
# the tests convert an embedding model with it (tests/modelgen/make_embedding_model.py).
step "copying llama.cpp's converter beside the libraries"
rm -rf "$dest/../convert" && mkdir -p "$dest/../convert"
cp -a "$work/llama.cpp/convert_hf_to_gguf.py" "$work/llama.cpp/conversion" "$work/llama.cpp/gguf-py" "$dest/../convert"/
step "done: the libraries are in $dest (kinfer loads them where LLAMA_CPP_LIB_PATH names that folder)"
echo "$dest"
