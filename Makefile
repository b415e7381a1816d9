# Set-up and the two everyday commands (README's "Set-up").
# torch: an installed one is kept (a CUDA build stays a CUDA build). Without one, a machine with an
# NVIDIA driver gets PyPI's default (CUDA) build and any other machine the CPU build from
# TORCH_CPU_INDEX: a bare `pip install torch` on Linux pulls a multi-GB CUDA build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_FLAGS ?=
RUN_ARGS ?=

.PHONY: install install-test run test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || \
	    if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install $(TORCH_PIP_FLAGS) "$(TORCH)"; \
	    else $(PYTHON) -m pip install $(TORCH_PIP_FLAGS) "$(TORCH)" --index-url $(TORCH_CPU_INDEX); fi
	$(PYTHON) -m pip install -e .

install-test: install
	$(PYTHON) -m pip install -e ".[test]"

run: install
	$(PYTHON) -m lpbench run $(RUN_ARGS)

test: install-test
	$(PYTHON) -m pytest -q
