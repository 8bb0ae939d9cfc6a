#!/usr/bin/env bash
# kinfer-rpc end to end on a CUDA machine, the way a client runs it (bench/gpu_e2e.py): spawn
# `kinfer-rpc`, load with every layer on the GPU, stream 1, 32 and 128 requests at once, cancel
# some, unload, shut down. From the repo root, with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] bash bench/gpu_e2e.sh [shapes...]       default: 1b 7b; reports in OUT (/tmp/out)
#   E2E_ARGS="--probe 8" adds the reproducibility probe (bench/gpu_e2e.py --help)
#   then tests/test_promise.py on each shape, every layer on the GPU: PROMISE_EXAMPLES mixes
#   (default 12; 0 skips it)
# This checkout is installed as a package (its entry points and the kinfer-rpc script; the
# machine's packages and .gpu's wheels are the dependencies) into /tmp/kinfer, and each shape's
# model is made here (random weights, Q4_K_M). Exits non-zero if any shape fails.
set -euo pipefail
shapes=${*:-1b 7b}
SHAPES=$shapes
. bench/gpu_setup.sh
for s in $shapes; do gpu_model "$s"; done
kinfer_install
echo "kinfer-rpc: $KINFER_RPC, llama.cpp: $LLAMA_CPP_LIB_PATH" | tee -a "$OUT/e2e.md"
rc=0
for s in $shapes; do
  python3 bench/gpu_e2e.py /tmp/m-$s.gguf --server-log "$OUT/server-$s.log" ${E2E_ARGS:-} | tee -a "$OUT/e2e.md" \
    || rc=1
  if [ "${PROMISE_EXAMPLES:-12}" != 0 ]; then  # the promise under hypothesis' mixes, every layer on the GPU
    echo "tests/test_promise.py, $s, ${PROMISE_EXAMPLES:-12} mixes:" | tee -a "$OUT/e2e.md"
    KINFER_PROMISE_MODEL=/tmp/m-$s.gguf KINFER_PROMISE_GPU_LAYERS=999 KINFER_PROMISE_EXAMPLES=${PROMISE_EXAMPLES:-12} \
      KINFER_PROMISE_CONTEXT=4096 python3 -m pytest -q -p no:cacheprovider tests/test_promise.py > "$OUT/promise-$s.log" 2>&1 \
      || rc=1
    grep -E "differs from|passed|failed|error" "$OUT/promise-$s.log" | tail -5 | tee -a "$OUT/e2e.md"
  fi
done
exit $rc
