# Sourced by the bench/gpu_*.sh scripts on a Linux machine with an NVIDIA GPU (CUDA; nvcc and cmake
# to build kinfer's patched libllama), from the repo root. It works offline from a folder .gpu in
# the checkout (ignored by git), prepared beforehand:
#   .gpu/llama-cuda.tgz.part-*   llama.cpp's prebuilt CUDA tools and libraries (the llama.cpp that
#                                llama-cpp-python 0.3.36 vendors), a .tgz cut with `split` (one
#                                part, part-aa, is fine), or the same as one .txz (xz: smaller)
#   .gpu/llama_cpp_python-0.3.36-py.tgz   llama-cpp-python's Python part
#   .gpu/*.whl                   the wheels kinfer needs beyond the machine's own Python packages
#                                (jsonrpcserver, jsonschema, ...; py-spy for gpu_bench.sh's profile)
#   .gpu/gguf-py                 llama.cpp's gguf Python package (tests/modelgen/make_model.py uses it)
#   .gpu/llama-src.tgz           llama.cpp's source as llama-cpp-python 0.3.36 vendors it
# Reports go to OUT (default /tmp/out). Defines gpu_model (below). Sets up, once per machine:
#   /tmp/lc   the prebuilt llama.cpp tools (llama-bench, llama-batched-bench, llama-server,
#             llama-quantize): the anchors, run as shipped, through LD_LIBRARY_PATH=/tmp/lc
#   /tmp/lck  kinfer's llama.cpp: the vendored source with patches/llama-*.patch, built here for
#             CUDA (sm_90) against the shared libstdc++, as a user's `pip install` builds it
#             (kinfer refuses the prebuilt libraries: they carry a static C++ runtime, see
#             kinfer_rpc/default_plugins/llama/native.py). LLAMA_CPP_LIB_PATH names it. PATCHED=0: the prebuilt.
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/lc /tmp/site "$OUT"
if [ ! -x /tmp/lc/llama-bench ]; then
  if [ -f .gpu/llama-cuda.txz ]; then tar xJf .gpu/llama-cuda.txz -C /tmp/lc
  else cat .gpu/llama-cuda.tgz.part-* | tar xzf - -C /tmp/lc; fi
  tar xzf .gpu/llama_cpp_python-0.3.36-py.tgz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
fi
export LD_LIBRARY_PATH=/tmp/lc LLAMA_CPP_LIB_PATH=/tmp/lc PYTHONPATH=/tmp/site:$PWD:$PWD/.gpu/gguf-py
# gpu_model SHAPE: /tmp/m-SHAPE.gguf, a Llama-shaped model of random weights at Q4_K_M
# (tests/modelgen/make_model.py --help lists the shapes), made once per machine.
gpu_model() {
  [ -f "/tmp/m-$1.gguf" ] && return 0
  python3 tests/modelgen/make_model.py "/tmp/m-$1-f16.gguf" --shape "$1" >/dev/null &&
    /tmp/lc/llama-quantize "/tmp/m-$1-f16.gguf" "/tmp/m-$1.part.gguf" Q4_K_M >/dev/null 2>&1 &&
    rm -f "/tmp/m-$1-f16.gguf" && mv "/tmp/m-$1.part.gguf" "/tmp/m-$1.gguf"
}
# kinfer_install: this checkout installed as a package into /tmp/kinfer (its entry points and the
# kinfer and kinfer-rpc scripts; the machine's packages and .gpu's wheels are the dependencies);
# PYTHONPATH, KINFER_RPC and KINFER point at it.
kinfer_install() {
  rm -rf /tmp/kinfer
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kinfer . >/dev/null
  export PYTHONPATH=/tmp/kinfer:/tmp/site KINFER_RPC=/tmp/kinfer/bin/kinfer-rpc KINFER=/tmp/kinfer/bin/kinfer
}
# SHAPES, set before sourcing this: make those models while kinfer's llama.cpp builds.
models_pid=
if [ -n "${SHAPES:-}" ]; then
  (for s in $SHAPES; do gpu_model "$s" || echo "the $s model was not made" >&2; done) &
  models_pid=$!
fi
if [ "${PATCHED:-1}" = 1 ] && [ -f .gpu/llama-src.tgz ]; then
  if [ ! -f /tmp/lck/libllama.so ]; then
    t0=$(date +%s)
    # $CC/$CXX may name a toolchain that links the C++ runtime statically; the system's compilers
    # link the shared one, as a user's pip install of llama-cpp-python does.
    if CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ BUILD_DIR=/tmp/lckb SRC=.gpu/llama-src.tgz \
        CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 ${CMAKE_ARGS:-}" \
        bash patches/build_llama.sh /tmp/lck >"$OUT/build-llama.log" 2>&1; then
      echo "kinfer's CUDA llama.cpp built in $(( $(date +%s) - t0 )) s" >&2
    else
      echo "kinfer's CUDA llama.cpp did not build (tail of $OUT/build-llama.log):" >&2
      tail -20 "$OUT/build-llama.log" >&2
    fi
  fi
  [ -f /tmp/lck/libllama.so ] && export LLAMA_CPP_LIB_PATH=/tmp/lck
fi
if [ -n "$models_pid" ]; then wait "$models_pid" || true; fi
