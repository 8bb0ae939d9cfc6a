#!/usr/bin/env bash
# On a CUDA machine (an H200 for docs/performance.md), from the repo root, with .gpu prepared as
# bench/gpu_setup.sh says; reports go to OUT (default /tmp/out):
#   bash bench/gpu_moe.sh            kinfer's engine: experts in host memory at 4096 / 2048, all on GPU
#   ANCHOR=1 bash bench/gpu_moe.sh   then llama-bench on the same file and splits (a second run)
# Writes a Qwen3-30B-A3B-shaped GGUF (random Q4_K weights, ~17 GiB) once per machine to /tmp.
set -euo pipefail
. bench/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
M=/tmp/moe-30b-a3b.gguf
if [ ! -f $M ]; then
  /usr/bin/time -f "model written in %e s" python3 tests/modelgen/make_moe_model.py $M --shape 30b-a3b
  ls -la $M
fi
free -g | head -2
THREADS=${THREADS:-16}
if [ -z "${ANCHOR:-}" ]; then
  python3 bench/moe_bench.py $M --prompt 7700 --ntg 64 --threads $THREADS --reps 2 | tee -a "$OUT/moe.jsonl"
else
  python3 bench/moe_bench.py $M --prompt 7700 --ntg 64 --threads $THREADS --anchor /tmp/lc --anchor-only | tee -a "$OUT/moe.jsonl"
fi
