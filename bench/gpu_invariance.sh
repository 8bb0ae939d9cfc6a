#!/usr/bin/env bash
# Batch invariance of kinfer's CUDA llama.cpp (patches/llama-cuda-batch-invariant.patch) and what it
# costs, on a CUDA machine, from the repo root, with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] bash bench/gpu_invariance.sh [shapes...]       default: 1b 7b
#   JOBS="probe batched" (default both):
#   probe:   bench/cuda_invariance.py with the patch's kernels off (GGML_CUDA_BATCH_INVARIANT=0, stock
#            ggml-cuda) and on (1, the default): sequence 0 alone vs among others, its prompt cut
#            into passes, its prefix copied. OUT/invariance-SHAPE-{stock,invariant}.jsonl
#   batched: llama-batched-bench (the prebuilt tool on kinfer's library) both ways: decode and
#            prompt tok/s at 1/8/32/128 at once. OUT/batched-SHAPE-{stock,invariant}.txt
# Through the server, bench/gpu_e2e.sh --probe measures the same promise the way a client meets it.
set -uo pipefail
shapes=${*:-1b 7b}
SHAPES=$shapes
. bench/gpu_setup.sh
jobs=" ${JOBS:-probe batched} "
[ "$LLAMA_CPP_LIB_PATH" = /tmp/lck ] || { echo "kinfer's CUDA llama.cpp is not built: nothing to measure" >&2; exit 1; }
rc=0
for s in $shapes; do
  gpu_model "$s" || { rc=1; continue; }
  for mode in 0 1; do
    name=$([ $mode = 1 ] && echo invariant || echo stock)
    if [[ $jobs == *" probe "* ]]; then
      GGML_CUDA_BATCH_INVARIANT=$mode LD_LIBRARY_PATH=/tmp/lck:/tmp/lc timeout "${PROBE_SECONDS:-240}" python3 bench/cuda_invariance.py \
        "/tmp/m-$s.gguf" ${PROBE_ARGS:-} > "$OUT/invariance-$s-$name.jsonl" 2> "$OUT/invariance-$s-$name.log" || rc=1
      echo "$s $name: $(tail -1 "$OUT/invariance-$s-$name.jsonl")"
    fi
    if [[ $jobs == *" batched "* ]]; then
      GGML_CUDA_BATCH_INVARIANT=$mode LD_LIBRARY_PATH=/tmp/lck:/tmp/lc timeout 240 /tmp/lc/llama-batched-bench \
        -m "/tmp/m-$s.gguf" -ngl 99 -fa on -c 40000 -b 4096 -ub 512 -npp 128 -ntg 128 -npl 1,8,32,128 \
        > "$OUT/batched-$s-$name.txt" 2>&1 || rc=1
      echo "$s $name batched:"; grep -E '^\|' "$OUT/batched-$s-$name.txt" || tail -5 "$OUT/batched-$s-$name.txt"
    fi
  done
done
exit $rc
