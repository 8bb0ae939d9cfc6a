#!/usr/bin/env bash
# A short H200 check (after STAGE=1/2 of gpu_mlx.sh and ONLY_SETUP): the attention kernel against
# MLX's, then the engine beside mlx-lm at 1 and 32 at once, dense weights.
set -uo pipefail
export PYTHONPATH=/tmp/mlxsite:$PWD:$PWD/plugins PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; M=/tmp/m7b
timeout 90 python3 bench/mlx_kernels.py --out "$OUT/mlx_kernels.json" 2>&1 | grep -v write
timeout 200 python3 bench/mlx_bench.py $M --out "$OUT/mlx_compare_dense.json" --npl ${NPL:-1,32} --npp 64 \
    --ntg ${NTG:-64} --weights dense 2>&1 | tail -4
