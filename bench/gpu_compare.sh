#!/usr/bin/env bash
# On a CUDA machine (an H200 for docs/performance.md), from the repo root, with .gpu prepared as
# bench/gpu_setup.sh says; reports go to OUT (default /tmp/out):
#   bash bench/gpu_compare.sh [shapes...]     default: 1b 7b
#   CURVE=0 skips the draft-count curve; POOL="7b" adds the prefix-pool runs on those shapes;
#   THREADS: both sides' CPU threads (unset: kinfer takes its default for the load, 2 with every layer on
#   the GPU, and llama.cpp's tools run at each of ANCHOR_THREADS, default the CPU count, the fastest kept).
# Synthesises Llama-shaped models with random weights, quantizes them to Q4_K_M, and runs
# bench/compare.py (llama-bench + llama-batched-bench vs kinfer's engine) on each.
set -euo pipefail
SHAPES="${*:-1b 7b}"
. bench/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for shape in "${@:-1b 7b}"; do
  for s in $shape; do
    gpu_model "$s"
    python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc ${THREADS:+--threads $THREADS} ${ANCHOR_THREADS:+--anchor-threads $ANCHOR_THREADS} --ngl 99 \
      --label "$s-shaped Q4_K_M, H200" ${KVU:+--kvu} | tee -a "$OUT/compare.md"
  done
done
# The cost of a pass checking k drafts vs one (speculative decoding), on the largest shape.
last=$(echo ${@:-1b 7b} | awk '{print $NF}')
if [ "${CURVE:-1}" = 1 ]; then
  python3 bench/drafts_bench.py --curve /tmp/m-$last.gguf --gpu-layers 99 --threads 8 | tee -a "$OUT/curve.jsonl"
fi
# The prefix pool: decode at 32/64/128 with the pool vs -kvu and with prefix -1 vs no
# -kvu, and the agent case (32 conversations sharing a 4,000-token system prompt).
if [ -n "${POOL:-}" ]; then
  for s in ${POOL}; do
    python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc ${THREADS:+--threads $THREADS} ${ANCHOR_THREADS:+--anchor-threads $ANCHOR_THREADS} --ngl 99 --npl 32,64,128 \
      --label "$s-shaped Q4_K_M, H200" --pool | tee -a "$OUT/pool.md"
    python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc ${THREADS:+--threads $THREADS} ${ANCHOR_THREADS:+--anchor-threads $ANCHOR_THREADS} --ngl 99 --npl 32,64,128 \
      --label "$s-shaped Q4_K_M, H200" | tee -a "$OUT/pool.md"
    python3 bench/prefix_bench.py /tmp/m-$s.gguf --system 4000 --n 32 --gpu-layers 99 --threads 8 | tee -a "$OUT/agent.jsonl"
  done
fi
