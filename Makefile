# Set-up and the two everyday commands. Keeps an installed torch (e.g. a CUDA build);
# otherwise installs the CPU build, since a bare `torch` pulls a multi-GB CUDA build.
PYTHON ?= python3

.PHONY: install install-test run test

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e .

install-test: install
	$(PYTHON) -m pip install -e ".[test]"

run: install
	$(PYTHON) -m lpbench run

test: install-test
	$(PYTHON) -m pytest -q
