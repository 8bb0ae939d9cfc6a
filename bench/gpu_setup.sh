# Sourced by the bench/gpu_*.sh scripts on the H200: unpack the prebuilt CUDA llama.cpp and
# llama-cpp-python's Python part from the carried .gpu folder (once per machine), make the
# kinfer_patches package importable, and export the paths every script runs with.
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/lc /tmp/site "$OUT"
if [ ! -x /tmp/lc/llama-bench ]; then
  cat .gpu/llama-cuda.tgz.part-* | tar xzf - -C /tmp/lc
  tar xzf .gpu/llama_cpp_python-0.3.36-py.tgz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
fi
ln -sfn "$PWD/patches" /tmp/site/kinfer_patches
export LD_LIBRARY_PATH=/tmp/lc LLAMA_CPP_LIB_PATH=/tmp/lc PYTHONPATH=/tmp/site:$PWD:$PWD/.gpu/gguf-py
# kinfer's patches to libllama (patches/README.md), built here from .gpu/llama-src.tgz (llama.cpp
# as llama-cpp-python 0.3.36 vendors it) and linked to the prebuilt CUDA ggml in /tmp/lc; the
# llama.cpp tools keep the prebuilt libllama. PATCHED=0 keeps it for kinfer too.
if [ "${PATCHED:-1}" = 1 ] && [ -f .gpu/llama-src.tgz ]; then
  if [ ! -f /tmp/lcp/libllama.so ]; then
    t0=$(date +%s)
    if SRC=.gpu/llama-src.tgz bash patches/build_llama.sh /tmp/lcp-all >/dev/null; then
      mkdir -p /tmp/lcp && cp -a /tmp/lcp-all/libllama.so* /tmp/lcp/
      echo "patched libllama built in $(( $(date +%s) - t0 )) s" >&2
    else
      echo "the patched libllama did not build: kinfer runs on the prebuilt one" >&2
    fi
  fi
  [ -f /tmp/lcp/libllama.so ] && export LLAMA_CPP_LIB_PATH=/tmp/lcp
fi
