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
