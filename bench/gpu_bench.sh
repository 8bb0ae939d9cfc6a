#!/usr/bin/env bash
# Decode with many sequences at once against llama-batched-bench, the prefix pool and the agent
# case, in one run on a CUDA machine (an H200 for docs/performance.md), from the repo root, with
# .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] JOBS="prefix loop pool agent" bash bench/gpu_bench.sh [shapes...]     default: 1b 7b
# For each shape (synthesised, Q4_K_M), the jobs named (default: prefix ab loop pool agent), each
# writing to OUT (default /tmp/out) as it goes:
#   prefix: kinfer with `prefix -1` vs llama-batched-bench without -kvu, 32/64/128 at once (compare.py),
#           ROUNDS times alternating (default 3; the medians), llama-batched-bench also on the patched
#           libllama when there is one
#   ab:     greedy rows' argmax in llama.cpp's pass (patches/llama-output-argmax.patch) vs on the host,
#           engine_bench --device-argmax auto|off, 2 alternating rounds
#   loop:   the llama backend alone in llama-batched-bench's loop and in a loop that feeds back its
#           argmax (loop_bench.py): what any server that samples can reach through llama.cpp
#   pool:   the prefix pool vs llama-batched-bench -kvu (compare.py --pool)
#   agent:  32 conversations sharing a 4,000-token system prompt, pool vs none (prefix_bench.py)
#   profile: py-spy (its wheel in .gpu) over the engine's steps and over loop_bench's device loop,
#           64 at once, 1024 tokens each: where the host's time goes (spy_summary.py)
set -euo pipefail
SHAPES=${*:-1b 7b}
. bench/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
shapes=${*:-1b 7b}
jobs=" ${JOBS:-prefix ab loop pool agent} "
for s in $shapes; do gpu_model "$s"; done
patched=
if [ "$LLAMA_CPP_LIB_PATH" = /tmp/lck ]; then  # which libllama llama-batched-bench loads on it
  patched=1; LD_LIBRARY_PATH=/tmp/lck:$LD_LIBRARY_PATH ldd /tmp/lc/llama-batched-bench | grep libllama | tee -a "$OUT/prefix-off.md" || true
fi
common="--tools /tmp/lc ${ANCHOR_THREADS:+--anchor-threads $ANCHOR_THREADS} --ngl 99 --npl 32,64,128"
for s in $shapes; do
  case $jobs in *" prefix "*)
    python3 bench/compare.py /tmp/m-$s.gguf $common --label "$s-shaped Q4_K_M, H200" --rounds "${ROUNDS:-3}" \
      ${patched:+--patched-lib /tmp/lck} | tee -a "$OUT/prefix-off.md";;
  esac
  case $jobs in *" ab "*)
    for r in 1 2; do for d in auto off; do
      python3 bench/engine_bench.py /tmp/m-$s.gguf --npp 128 --ntg 128 --npl 32,64,128 --gpu-layers 99 \
        --kv-type f16 --phases --device-argmax $d | sed "s/^{/{\"shape\": \"$s\", \"round\": $r, /" | tee -a "$OUT/ab.jsonl"
    done; done;;
  esac
  case $jobs in *" profile "*)
    spy="/tmp/site/bin/py-spy record -r 2000 --native -f raw"
    $spy -o "$OUT/spy-engine-$s.txt" -- python3 bench/engine_bench.py /tmp/m-$s.gguf --npp 128 --ntg 1024 --npl 64 \
      --gpu-layers 99 --kv-type f16 --prefix -1 --phases >>"$OUT/profile-$s.txt" 2>/dev/null
    $spy -o "$OUT/spy-loop-$s.txt" -- python3 bench/loop_bench.py /tmp/m-$s.gguf --npl 64 --ntg 1024 \
      --gpu-layers 99 --modes device >>"$OUT/profile-$s.txt" 2>/dev/null
    for w in "engine Engine.step" "loop loop_bench.py"; do set -- $w
      echo "## $1 ($2)"; python3 bench/spy_summary.py "$OUT/spy-$1-$s.txt" "$2"
    done >>"$OUT/profile-$s.txt"
    set --;;
  esac
  case $jobs in *" loop "*)
    python3 bench/loop_bench.py /tmp/m-$s.gguf --npl 32,64,128 --gpu-layers 99 \
      | sed "s/^{/{\"shape\": \"$s\", /" | tee -a "$OUT/loop.jsonl";;
  esac
done
for s in $shapes; do
  case $jobs in *" pool "*)
    python3 bench/compare.py /tmp/m-$s.gguf $common --label "$s-shaped Q4_K_M, H200" --pool | tee -a "$OUT/pool.md";;
  esac
  case $jobs in *" agent "*)
    python3 bench/prefix_bench.py /tmp/m-$s.gguf --system 4000 --n 32 --gpu-layers 99 --threads 8 \
      | sed "s/^{/{\"shape\": \"$s\", /" | tee -a "$OUT/agent.jsonl";;
  esac
done
