#!/usr/bin/env bash
# One-off (after STAGE=1/2 of gpu_mlx.sh and ONLY_SETUP): the comparison through the engine's worker
# thread; where it aborts, once more with the kernel's load-time check off, to localise the abort.
set -uo pipefail
export PYTHONPATH=/tmp/mlxsite:$PWD:$PWD/plugins PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; M=/tmp/m7b
timeout 280 python3 bench/mlx_bench.py $M --out "$OUT/mlx_compare_dense.json" --npl ${NPL:-1,8,32,128} --npp 64 \
    --ntg 128 --weights dense 2>&1 | tail -30 | tee "$OUT/mlx_compare_dense.md"
echo "compare rc $?"
timeout 100 python3 bench/mlx_bench.py $M --out "$OUT/mlx_inv.json" --mode invariance --npl 8,32 --ntg 64 --weights dense 2>&1 | tail -5
timeout 80 python3 bench/mlx_bench.py $M --out "$OUT/mlx_curve.json" --mode curve --kmax 16 --weights dense 2>&1 | tail -25
