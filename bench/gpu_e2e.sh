#!/usr/bin/env bash
# kinfer-rpc end to end on a CUDA machine, the way a client runs it (bench/gpu_e2e.py): spawn
# `kinfer-rpc`, load with every layer on the GPU, stream 1, 32 and 128 requests at once, cancel
# some, unload, shut down. From the repo root, with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] bash bench/gpu_e2e.sh [shapes...]       default: 1b 7b; reports in OUT (/tmp/out)
#   E2E_ARGS="--probe 8" adds the reproducibility probe (bench/gpu_e2e.py --help)
# This checkout is installed as a package (its entry points and the kinfer-rpc script; the
# machine's packages and .gpu's wheels are the dependencies) into /tmp/kinfer, and each shape's
# model is made here (random weights, Q4_K_M). Exits non-zero if any shape fails.
set -euo pipefail
shapes=${*:-1b 7b}
SHAPES=$shapes
. bench/gpu_setup.sh
for s in $shapes; do gpu_model "$s"; done
rm -rf /tmp/kinfer
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kinfer . >/dev/null
export PYTHONPATH=/tmp/kinfer:/tmp/site KINFER_RPC=/tmp/kinfer/bin/kinfer-rpc
echo "kinfer-rpc: $KINFER_RPC, llama.cpp: $LLAMA_CPP_LIB_PATH" | tee -a "$OUT/e2e.md"
rc=0
for s in $shapes; do
  python3 bench/gpu_e2e.py /tmp/m-$s.gguf --server-log "$OUT/server-$s.log" ${E2E_ARGS:-} | tee -a "$OUT/e2e.md" \
    || rc=1
done
exit $rc
