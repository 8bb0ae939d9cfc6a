#!/usr/bin/env bash
# kinfer-rpc on one host with two (or more) GPUs, through the server as a client runs it: each shape
# (default 7b) loaded on one GPU (splitMode none), split by layer, by row and by tensor; for each,
# prompt tok/s and decode tok/s at 1, 32 and 128 requests at once (bench/split_bench.py), then the
# reproducibility probe under each split that loads (bench/gpu_e2e.py --probe, every layer on the
# GPUs). A split llama.cpp refuses (row on CUDA: its ggml-cuda has no split buffers) is reported
# with its error. From the repo root, with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] [SPLITS=none,layer,row,tensor] [NPL=1,32,128] [PROBE_SPLITS="none layer tensor"]
#     bash bench/gpu_multi.sh [shapes...]                     reports in OUT/multi.md (OUT: /tmp/out)
# Exits non-zero if a measurement or a probe fails.
set -euo pipefail
shapes=${*:-7b}
SHAPES=$shapes
. bench/gpu_setup.sh
for s in $shapes; do gpu_model "$s"; done
kinfer_install
{
  echo "kinfer-rpc: $KINFER_RPC, llama.cpp: $LLAMA_CPP_LIB_PATH"
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
} | tee -a "$OUT/multi.md"
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 2 ]; then
  echo "only $gpus GPU here: every split has one device" | tee -a "$OUT/multi.md"
fi
rc=0
for s in $shapes; do
  echo "## $s over $gpus GPUs: splitMode ${SPLITS:-none,layer,row,tensor} (bench/split_bench.py)" | tee -a "$OUT/multi.md"
  python3 bench/split_bench.py "/tmp/m-$s.gguf" --splits "${SPLITS:-none,layer,row,tensor}" \
    --npl "${NPL:-1,32,128}" --npp 128 --ntg 64 --context 512 | tee -a "$OUT/multi.md" || rc=1
  for split in ${PROBE_SPLITS:-none layer tensor}; do
    echo "### $s, splitMode $split: end to end and the reproducibility probe (bench/gpu_e2e.py)" | tee -a "$OUT/multi.md"
    python3 bench/gpu_e2e.py "/tmp/m-$s.gguf" --at-once 1,32 --probe 8 --server-log "$OUT/server-$s-$split.log" \
      --load-options "{\"splitMode\": \"$split\"}" | tee -a "$OUT/multi.md" || rc=1
  done
done
exit $rc
