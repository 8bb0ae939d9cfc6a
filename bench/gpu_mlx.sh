#!/usr/bin/env bash
# The mlx backend on a CUDA machine (MLX's CUDA build; an H200 for docs/performance.md), beside
# mlx-lm on the same model, in one run, from the repo root. It installs offline from .gpu2, which
# is prepared on a machine with internet access:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 --no-deps \
#       mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2  (+ mlx-lm's pure dependencies: transformers,
#       huggingface_hub, tokenizers, safetensors, sentencepiece, regex, pyyaml, ...)
#   split -b 44M mlx_cuda_13-*.whl into parts cuda.part-* in .gpu2/m1 and .gpu2/m2; the other wheels
#   and a small GGUF with SmolLM2's vocabulary, tok.gguf (tests/modelgen/make_draft_model.py --layers 1
#   --embd 32), in .gpu2/m3; kinfer's own dependencies the machine lacks (jsonrpcserver and OSlash
#   built as wheels with `pip wheel`, jsonschema and its dependencies, llguidance, attrs, pluggy) in
#   .gpu2/m1 beside the first part: without them the jobs that spawn kinfer-rpc fail at its import.
# Runs, in order (they share /tmp/c):
#   STAGE=1 bash bench/gpu_mlx.sh, then STAGE=2: copy the parts from .gpu2/m1 and .gpu2/m2
#   STAGE=3 bash bench/gpu_mlx.sh (the default): install, model, then JOBS (default: kernels, probe,
#   curve, compare in both weight forms, defaults, invariance; ablate, e2e, drafts, pair and moe
#   on request). Reports go to OUT (default /tmp/out). If /tmp is cleared in between, start again
#   from STAGE=1; later STAGE=3 runs on the same machine need no .gpu2.
set -euo pipefail
mkdir -p /tmp/c
case "${STAGE:-3}" in
  1) cp .gpu2/m1/* /tmp/c/; exit 0 ;;
  2) cp .gpu2/m2/* /tmp/c/; exit 0 ;;
esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .gpu2/m3 ]; then cp .gpu2/m3/* /tmp/c/; fi
if [ ! -d /tmp/mlxsite/mlx ]; then
  cat /tmp/c/cuda.part-* > /tmp/c/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/mlxsite /tmp/c/*.whl
fi
# This checkout as a package (its entry points, the kinfer-rpc script) for the jobs that spawn the server.
rm -rf /tmp/kinfer
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kinfer . >/dev/null
export PYTHONPATH=/tmp/kinfer:/tmp/mlxsite:$PWD KINFER_RPC=/tmp/kinfer/bin/kinfer-rpc
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.array([1.0, 2.0]).sum().item())"
python3 -c "import jsonrpcserver" 2>/dev/null ||
  echo "jsonrpcserver is not installed (.gpu2/m1 lacks its wheel): the jobs that spawn kinfer-rpc will fail" >&2
M=/tmp/m7b
# The 7.4B Llama shape of docs/performance.md's MLX figures (vocabulary 128256), random 4-bit weights.
SHAPE_74B="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256 --bits 4"
[ -f $M/config.json ] || python3 tests/modelgen/make_mlx_model.py $M $SHAPE_74B --tokenizer-gguf /tmp/c/tok.gguf
[ -n "${ONLY_SETUP:-}" ] && exit 0
# A small draft model with the same vocabulary (2 layers, hidden 512), for the draft-model policy.
D=/tmp/m7b-draft
draft_model() {
  [ -f $D/config.json ] || python3 tests/modelgen/make_mlx_model.py $D --hidden 512 --layers 2 --heads 8 \
      --kv-heads 2 --intermediate 1024 --vocab 128256 --bits 4 --tokenizer-gguf /tmp/c/tok.gguf --seed 1
}
# JOBS picks what runs (default: all of them, in this order).
for job in ${JOBS:-kernels probe curve compare defaults invariance}; do
  case $job in
    probe)  # where a decode pass spends its time, per row count, beside mlx-lm's plain forward
      timeout 240 python3 bench/mlx_probe.py $M --rows ${ROWS:-1,32,128} ${PROBE_ARGS:-} --out "$OUT/mlx_probe.json" | tee "$OUT/mlx_probe.md" ;;
    kernels)  # the decode attention kernel checked against MLX's, the KV writes' cost in each form, and the
      # row-invariant matmul checked and timed against MLX's products (PARTS picks among them)
      timeout 300 python3 bench/mlx_kernels.py --out "$OUT/mlx_kernels.json" --parts ${PARTS:-attention,writes,matmul} ${KROWS:+--rows $KROWS} \
          | tee "$OUT/mlx_kernels.md" || true ;;
    ablate)  # the decode pass with parts of its attention swapped for mlx-lm's; also without cuDNN's SDPA
      for env in KINFER_MLX_ATTENTION=0 "KINFER_MLX_ATTENTION=0 MLX_CUDA_USE_CUDNN_SDPA=0" "KINFER_MLX_ATTENTION=0 MLX_USE_CUDA_GRAPHS=0"; do
        echo "== ablate ${env:-defaults}"
        env $env timeout 200 python3 bench/mlx_probe.py $M --ablate --rows ${ROWS:-1,32,128} | tee -a "$OUT/mlx_ablate.md" || true
      done ;;
    curve)
      timeout 120 python3 bench/mlx_bench.py $M --out "$OUT/mlx_curve.json" --mode curve --kmax 16 \
          --weights ${CURVE_WEIGHTS:-dense} | tee "$OUT/mlx_curve.md" ;;
    compare)  # both weight forms (mlx-lm gets the same form) unless FORMS says otherwise
      for W in ${FORMS:-dense quantized}; do
        timeout 300 python3 bench/mlx_bench.py $M --out "$OUT/mlx_compare_$W.json" --npl ${NPL:-1,8,32,128} --npp 64 \
            --ntg ${NTG:-128} --weights $W --phases --rounds ${ROUNDS:-3} | tee "$OUT/mlx_compare_$W.md" || true
      done ;;
    defaults)  # each side's defaults in one run: kinfer's choice of weights (WEIGHTS=dense|quantized
      # sets it instead), mlx-lm on the model as stored
      timeout 300 python3 bench/mlx_bench.py $M --out "$OUT/mlx_compare_defaults.json" --npl ${NPL:-1,8,32,128} \
          --npp 64 --ntg 128 --mlx-lm-as-stored ${WEIGHTS:+--weights $WEIGHTS} --rounds ${ROUNDS:-3} \
          | tee "$OUT/mlx_compare_defaults.md" ;;
    e2e)  # kinfer-rpc as a client spawns it: the model on the GPU, 1/32/128 streamed, some cancelled,
      # unloaded, shut down (bench/gpu_e2e.py); again with a small draft model of the same vocabulary
      draft_model
      timeout 300 python3 bench/gpu_e2e.py $M --probe 8 --server-log "$OUT/server-mlx.log" | tee "$OUT/e2e_mlx.md" ||
          echo "gpu_e2e.py failed on $M" >&2
      timeout 200 python3 bench/gpu_e2e.py $M --at-once 1,32 --server-log "$OUT/server-mlx-draft.log" \
          --load-options "{\"draftPolicy\": \"draft-model\", \"draftModel\": \"$D\"}" | tee -a "$OUT/e2e_mlx.md" ||
          echo "gpu_e2e.py with the draft model failed on $M" >&2 ;;
    drafts)  # drafting on mlx, one request: n-gram and the small draft model against no drafting, same replies
      draft_model
      timeout 240 python3 bench/drafts_bench.py $M --backend mlx --drafts ${DRAFTS:-4,13} --draft-model $D \
          --max-tokens 256 | tee "$OUT/mlx_drafts.md" || true ;;
    pair)  # drafting with drafts that are accepted: a 7.4B target whose layers after the second write
      # nothing and a draft of its first two layers (make_mlx_model.py --draft-pair), same replies
      P=/tmp/m7b-pair
      [ -f $P/config.json ] || python3 tests/modelgen/make_mlx_model.py $P $SHAPE_74B --tokenizer-gguf /tmp/c/tok.gguf \
          --draft-pair $P-draft --draft-layers 2
      timeout 240 python3 bench/drafts_bench.py $P --backend mlx --drafts ${DRAFTS:-4,13} --draft-model $P-draft \
          --max-tokens 256 | tee "$OUT/mlx_pair.md" || true ;;
    moe)  # a mixture of experts of Qwen3-30B-A3B's layer shapes (MOE_LAYERS of its 48 layers), 4-bit, beside
      # mlx-lm in the same form: decode at NPL at once (every kinfer step in the JSON), then one long prompt
      MOE=/tmp/moe30
      [ -f $MOE/config.json ] || python3 tests/modelgen/make_mlx_moe_model.py $MOE --shape 30b-a3b \
          --layers ${MOE_LAYERS:-16} --bits 4 --group 64 --tokenizer-gguf /tmp/c/tok.gguf
      for W in ${MOE_FORMS:-quantized}; do
        timeout 300 python3 bench/mlx_bench.py $MOE --out "$OUT/mlx_moe_$W.json" --npl ${NPL:-1,8,32,128} --npp 64 \
            --ntg ${NTG:-128} --weights $W --trace | tee "$OUT/mlx_moe_$W.md" || true
      done
      timeout 200 python3 bench/mlx_bench.py $MOE --out "$OUT/mlx_moe_prompt.json" --npl 1 --npp 7700 --ntg 16 \
          --weights quantized | tee "$OUT/mlx_moe_prompt.md" || true ;;
    invariance)
      timeout 120 python3 bench/mlx_bench.py $M --out "$OUT/mlx_inv.json" --mode invariance --npl 8,32 --ntg 64 \
          | tee "$OUT/mlx_inv.md" || true ;;
  esac
done
