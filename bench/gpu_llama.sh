#!/usr/bin/env bash
# llama.cpp on a CUDA machine (an H200 for docs/performance.md): kinfer's engine vs llama-bench /
# llama-batched-bench, and drafting on a real model. From the repo root, with .gpu prepared as
# bench/gpu_setup.sh says; reports go to OUT (default /tmp/out). Runs, in order (they share /tmp):
#   STAGE=a bash bench/gpu_llama.sh, then STAGE=b: copy the SmolLM2 GGUF, split in parts
#       (split -b 48M, smol.part-*) under .gpu2/a and .gpu2/b, to /tmp/c for the drafting runs
#       (or put the parts in /tmp/c yourself and skip these two)
#   STAGE=1b bash bench/gpu_llama.sh: 1b shape at 1/8/32/128 (prefix -1 vs llama-batched-bench),
#       at 32/64/128 with the pool vs -kvu, and drafting on SmolLM2
#   STAGE=7b bash bench/gpu_llama.sh: 7b shape, the same without drafting
set -euo pipefail
mkdir -p /tmp/c
case "${STAGE}" in
  a) cp .gpu2/a/* /tmp/c/; exit 0 ;;
  b) cp .gpu2/b/* /tmp/c/; exit 0 ;;
esac
. bench/gpu_setup.sh
s=$STAGE
gpu_model "$s"
L="$s-shaped Q4_K_M, H200"
if [ "$s" = 1b ] && ls /tmp/c/smol.part-* >/dev/null 2>&1; then
  cat /tmp/c/smol.part-* > /tmp/smol.gguf
  timeout 200 python3 bench/drafts_bench.py /tmp/smol.gguf --gpu-layers 99 --threads 8 --drafts 4,8 \
    --max-tokens 200 --draft-model /tmp/smol.gguf | tee -a "$OUT/drafts_gpu.jsonl" || true
fi
NPL=${NPL:-1,8,32,128}
[ "$s" = 1b ] && python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc --threads 8 --ngl 99 --npl $NPL --label "$L" | tee -a "$OUT/compare.md"
python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc --threads 8 --ngl 99 --npl 32,64,128 --label "$L" | tee -a "$OUT/pool.md"
python3 bench/compare.py /tmp/m-$s.gguf --tools /tmp/lc --threads 8 --ngl 99 --npl 32,64,128 --label "$L" --pool | tee -a "$OUT/pool.md"
