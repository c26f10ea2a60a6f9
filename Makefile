# The whole set-up is two commands: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU wheel these machines keep on disk (a looser spec
	# can pull a multi-GB CUDA build); the project's own range accepts it.
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	# torchft: the torchft baseline's extra; it keeps the torch installed above.
	$(PY) -m pip install --quiet -e '.[dev,torchft]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m recover.experiments.demo

test: $(STAMP)
	$(PY) -m pytest -q

# The inner loop: pure and property tests only, no process started (RECOVER_FAST=1
# makes any unmarked test that starts one fail; see tests/conftest.py).
test-fast: $(STAMP)
	RECOVER_FAST=1 $(PY) -m pytest -q -m "not procs and not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
