#!/usr/bin/env bash
# What llama.cpp's RPC backend costs on a GPU, through kinfer-rpc (bench/rpc_bench.py): one
# `kinfer rpc-server` on this host serving its first CUDA device over loopback, and the same model
# loaded in one kinfer-rpc locally (every layer on the GPU) and through the server (tensorSplit
# 0,1: every layer on the server's device). From the repo root, with .gpu prepared as
# bench/gpu_setup.sh says:
#   [OUT=dir] [NPL=1,32] bash bench/gpu_rpc.sh [shapes...]     default: 1b 7b; reports in OUT
set -euo pipefail
shapes=${*:-1b 7b}
SHAPES=$shapes
. bench/gpu_setup.sh
for s in $shapes; do gpu_model "$s"; done
base=$PYTHONPATH
kinfer_install
export PYTHONPATH=$PYTHONPATH:$base
for s in $shapes; do
  echo "## RPC over loopback, $s (every layer on the GPU; kinfer-rpc local vs through the server)" | tee -a "$OUT/rpc.md"
  python3 bench/rpc_bench.py /tmp/m-$s.gguf --start 1 --device CUDA0 --tensor-split 0,1 --threads 4 \
    --npl "${NPL:-1,32}" --npp 128 --ntg 64 --kv-type f16 --context 2048 | tee -a "$OUT/rpc.md"
done
