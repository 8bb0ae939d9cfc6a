#!/usr/bin/env bash
# Reliability and the editor's replay on a CUDA machine, every layer on the GPU, from the repo root
# with .gpu prepared as bench/gpu_setup.sh says:
#   [OUT=dir] [PARTS="faults storm soak replay"] [STORM=5000] [SOAK_SECONDS=120] bash bench/gpu_reliability.sh
# faults: bench/gpu_faults.py (loads that overcommit the device, a burst past the KV budget, a huge
#         prompt) on the 1b shape
# storm:  tests/soak/test_soak.py's long cancel storm (STORM requests), each reply checked against its
#         lone run
# soak:   tests/soak/soak.py, 64 streams for SOAK_SECONDS (RSS, device memory, tok/s over time)
# replay: bench/lsp_replay.py, the keystroke replay through the LSP mode on the 1b shape with
#         fill-in-the-middle tokens (tests/modelgen/make_fim_model.py), with and without cacheReuse,
#         and llama-server's /infill on the same keystrokes
# Reports in OUT (default /tmp/out). Exits non-zero if a part fails.
set -uo pipefail
SHAPES=1b
. bench/gpu_setup.sh
kinfer_install
M=/tmp/m-1b.gguf
rc=0
for part in ${PARTS:-faults storm soak replay}; do
  t0=$(date +%s)
  case $part in
    faults)
      timeout 400 python3 bench/gpu_faults.py "$M" --out "$OUT/faults.json" > "$OUT/faults.jsonl" 2> "$OUT/faults.err" || rc=1;;
    storm)
      KINFER_SOAK_MODEL=$M KINFER_SOAK_GPU_LAYERS=999 KINFER_LONG_STORM_REQUESTS=${STORM:-5000} timeout 500 \
        python3 -m pytest -q -s -p no:cacheprovider -m slow tests/soak/test_soak.py -k storm > "$OUT/storm.log" 2>&1 || rc=1;;
    soak)
      timeout $(( ${SOAK_SECONDS:-120} + 200 )) python3 tests/soak/soak.py --model "$M" --gpu-layers 999 \
        --seconds "${SOAK_SECONDS:-120}" --streams 64 --out "$OUT/soak.json" > "$OUT/soak.log" 2>&1 || rc=1;;
    replay)
      [ -f /tmp/fim-1b.gguf ] || python3 tests/modelgen/make_fim_model.py /tmp/fim-1b.gguf --source "$M"
      for extra in "" "--cache-reuse 256"; do
        timeout 300 python3 bench/lsp_replay.py --model /tmp/fim-1b.gguf --gpu-layers 999 --max-tokens 8 --only pool \
          $extra >> "$OUT/replay.jsonl" 2>> "$OUT/replay.err" || rc=1
      done
      timeout 300 python3 bench/lsp_replay.py --model /tmp/fim-1b.gguf --gpu-layers 999 --max-tokens 8 --keys 250 \
        --llama-server /tmp/lc/llama-server >> "$OUT/replay.jsonl" 2>> "$OUT/replay.err" || rc=1;;
  esac
  echo "$part: $(( $(date +%s) - t0 )) s, rc so far $rc" | tee -a "$OUT/reliability.md"
done
exit $rc
