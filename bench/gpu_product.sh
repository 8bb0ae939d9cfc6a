#!/usr/bin/env bash
# The product against its engine and llama-server on a CUDA machine (bench/product_bench.py), from
# the repo root with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] [JOBS="greedy sampled profile"] [NPL=32,128] [NTG=64,256] bash bench/gpu_product.sh [shapes...]
# For each shape (default: 1b 7b; synthesised, Q4_K_M), the jobs named (default: greedy), each
# writing JSON lines to OUT (default /tmp/out):
#   greedy:  kinfer-rpc through the Python client and a minimal raw client, the raw client through
#            kinfer-rpc --attach to a daemon, OpenAI's /v1/completions on the daemon's HTTP face,
#            kinfer's engine alone and llama-server -np N (through the same HTTP client), prompts
#            of 128 tokens, greedy; the server's trace summarized per round (KINFER_TRACE)
#   sampled: the same with temperature 0.8 (seeded), kinfer's sides only
#   profile: py-spy over the server (raw client, 128 at once, 256 tokens): where its time goes
# BASE=DIR (a folder holding another kinfer_rpc package) also runs the sampled job's raw client on
# that code, in the same call, to compare two versions side by side.
set -euo pipefail
SHAPES=${*:-1b 7b}
. bench/gpu_setup.sh
for s in $SHAPES; do gpu_model "$s"; done
kinfer_install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/product.md"
jobs=" ${JOBS:-greedy} "
npl=${NPL:-32,128}
ntg=${NTG:-64,256}
for s in $SHAPES; do
  m=/tmp/m-$s.gguf
  case $jobs in *" greedy "*)
    python3 bench/product_bench.py "$m" --gpu-layers 999 --npl "$npl" --ntg "$ntg" --engine \
      --clients "${CLIENTS:-python,raw,attach,http}" --llama-server /tmp/lc/llama-server --trace "$OUT/trace-$s" \
      | sed "s/^{/{\"shape\": \"$s\", /" | tee -a "$OUT/product.jsonl";;
  esac
  case $jobs in *" sampled "*)
    if [ -n "${BASE:-}" ]; then
      PYTHONPATH=$BASE:/tmp/site KINFER_RPC="python3 -m kinfer_rpc" python3 bench/product_bench.py "$m" \
        --gpu-layers 999 --npl "$npl" --ntg "$ntg" --clients raw --temperature 0.8 \
        | sed "s/^{/{\"shape\": \"$s\", \"code\": \"base\", /" | tee -a "$OUT/product.jsonl"
    fi
    python3 bench/product_bench.py "$m" --gpu-layers 999 --npl "$npl" --ntg "$ntg" --engine --clients raw,python \
      --temperature 0.8 --trace "$OUT/trace-sampled-$s" | sed "s/^{/{\"shape\": \"$s\", /" \
      | tee -a "$OUT/product.jsonl";;
  esac
  case $jobs in *" profile "*)
    KINFER_RPC="/tmp/site/bin/py-spy record -r 1000 --native -f raw -o $OUT/spy-server-$s.txt -- $KINFER_RPC" \
      python3 bench/product_bench.py "$m" --gpu-layers 999 --npl 128 --ntg 256 --clients raw \
      | sed "s/^{/{\"shape\": \"$s\", \"profiled\": true, /" | tee -a "$OUT/product.jsonl"
    python3 bench/spy_summary.py "$OUT/spy-server-$s.txt" > "$OUT/spy-server-$s.md" || true;;
  esac
done
