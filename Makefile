# make demo: set up .venv if missing, then run the demo (python -m compiled_attn; ~2 minutes on
#            2 CPUs, plus ~2.5 minutes of set-up the first time).
# make test: set up .venv if missing, then run the CPU test suite (reference, API, ops, FX
#            rewrites, packaging, benchmarks harness) in parallel workers, then the kernels under
#            the Triton interpreter. Each target prints its total time, set-up included.
# make test-gpu: the GPU tier, on a CUDA machine (see the target).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.compiled_attn-installed
# pytest-xdist workers for make test (auto: one per CPU). worksteal: each worker starts on a
# contiguous half of the tests (so a module's tests, and its module-scoped fixtures such as
# built AOTInductor packages, stay on one worker) and an idle worker takes from the other's tail.
# ('load' deals tests round-robin and builds such fixtures on every worker; 'loadfile' leaves
# the longest module finishing alone; pytest 9.2 ignores xdist's loadgroup.)
WORKERS ?= auto
XDIST  := -n $(WORKERS) --dist worksteal
# One Inductor compile thread per test process: with a pool, every xdist worker (and every
# subprocess a test starts) would first start one Python + torch per CPU, for graphs whose few
# C++ kernels compile sooner than that pool starts. Bytecode written on first import
# (PYTHONDONTWRITEBYTECODE emptied, where the environment sets it): the set-up installs without
# compiling every module of torch and the rest ahead (pip's --no-compile: 60-70 s of the
# set-up), and the first process to import a module compiles it once for every later one (the
# suite starts some forty Python processes).
PYC_ENV  := PYTHONDONTWRITEBYTECODE=
TEST_ENV := TORCHINDUCTOR_COMPILE_THREADS=1 $(PYC_ENV)
# pip prints errors only; the set-up's own lines say what it is doing
PIP    := $(PY) -m pip install -qq --no-compile

.PHONY: demo test test-gpu setup clean

setup: $(STAMP)

# torch is pinned to 2.13.0 here: that is the CPU build on this machine's local disk; a looser
# pin would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@echo "setup: creating $(VENV) (first run only: about 2.5 minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup: installing torch 2.13.0 (CPU build)"
	@$(PIP) torch==2.13.0
	@$(PIP) setuptools wheel
	@echo "setup: installing compiled_attn (editable) with its test, bench and demo extras"
	@$(PIP) --no-build-isolation -e '.[test,bench,demo]'
	@touch $(STAMP)
	@echo "setup: done"

demo:
	@start=$$(date +%s); \
	$(MAKE) -s --no-print-directory setup || exit $$?; \
	$(PYC_ENV) $(PY) -m compiled_attn; rc=$$?; \
	echo "make demo: $$(( $$(date +%s) - start )) s in all, set-up included"; exit $$rc

test:
	@start=$$(date +%s); \
	$(MAKE) -s --no-print-directory setup || exit $$?; \
	echo "test: the CPU suite in parallel workers (-n $(WORKERS))"; \
	$(TEST_ENV) $(PY) -m pytest -q $(XDIST) --durations=15 tests --ignore=tests/interpret; rc=$$?; \
	echo "test: the kernels under the Triton interpreter (TRITON_INTERPRET=1)"; \
	$(TEST_ENV) TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) tests/interpret || rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s in all, set-up included"; exit $$rc

# On the GPU machine (torch and triton preinstalled; no network): pytest-xdist's wheels are
# carried in .whl/ (docs/benchmarks.md) and `source dev/gpu_setup.sh` installs them with the
# project. The GPU tier runs in 8 workers at once (most of its time is Triton and Gluon
# compiling kernels on the CPUs; each worker is its own CUDA context on the one GPU), then the
# gpu_solo tests, which need most of the GPU's memory, alone. Each test's outcome is printed as
# it finishes (-v: a run cut short by a time limit still names its failures); GPU_TESTS narrows
# the selection (e.g. GPU_TESTS=tests/test_head_dims_gpu.py) to split the tier over calls.
# GPU_SHARD=I/N runs the I-th of N parts (tests/conftest.py --shard): the whole tier takes longer
# than one 10-minute call on an H200 (pytest's own time 4-5 minutes a shard on 2026-11-28), so it
# runs as 1/3, 2/3, 3/3. A shard that holds no gpu_solo test is not a failure (pytest's exit 5).
# On a two-GPU machine two shards run at once, one a GPU, in the time of one (2026-11-28):
#     CUDA_VISIBLE_DEVICES=0 make test-gpu GPU_SHARD=1/3 & CUDA_VISIBLE_DEVICES=1 make test-gpu GPU_SHARD=2/3
GPU_TESTS ?= tests
GPU_SHARD ?=
SHARD := $(if $(GPU_SHARD),--shard $(GPU_SHARD))
test-gpu:
	@python3 -c "import xdist" 2>/dev/null || { echo "test-gpu: needs pytest-xdist (pip install pytest-xdist, or its wheels in .whl/ and source dev/gpu_setup.sh)"; exit 2; }
	python3 -m pytest -v -rfE -n 8 -m "gpu and not gpu_solo" $(SHARD) $(GPU_TESTS)
	python3 -m pytest -v -rfE -m "gpu and gpu_solo" $(SHARD) $(GPU_TESTS); rc=$$?; \
	    [ $$rc -ne 5 ] || { echo "test-gpu: no gpu_solo test in this selection"; rc=0; }; exit $$rc

clean:
	rm -rf $(VENV) build dist *.egg-info
