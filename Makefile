# make demo: set up .venv if missing, then run the main job.
# make test: set up .venv if missing, then run the CPU test suite (reference, API, ops, kernels
#            under the Triton interpreter, FX rewrites, packaging).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.compiled_attn-installed

.PHONY: demo test test-gpu setup clean

setup: $(STAMP)

# torch is pinned to 2.13.0 here: that is the CPU build on this machine's local disk; a looser
# pin would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m compiled_attn

test: $(STAMP)
	$(PY) -m pytest -q tests
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/interpret

# On the GPU machine (torch and triton preinstalled there): pip install --no-deps
# --no-build-isolation -e . first. The GPU tier runs as 8 pytest processes at once (most of it
# is compiling kernels on the CPUs): tests/gpu_tier.py, logs under $OUT or here.
test-gpu:
	python3 tests/gpu_tier.py --shards 8 tests

clean:
	rm -rf $(VENV) build dist *.egg-info
