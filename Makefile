# The whole set-up is two commands: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench clean slurm-packages

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

# Three pytest workers (pytest-xdist) on two cores: the real-process tests spend about
# half their time waiting (heartbeats, deadlines, paced microbatches, process starts),
# so a third worker fills that idle time. Measured on this 2-core machine, beside other
# load: the whole suite took 15 min with three workers where two took 24; every
# fault-tolerance test bounds its waits by liveness and progress, not by wall time, so
# the extra load slows the suite without failing it. Each test file stays on one worker
# (--dist loadfile): module-scoped reference runs are made once, not per worker. Files go
# out longest first (tests/conftest.py orders them by their real-process tests; xdist's
# own reorder, by number of tests, is turned off because it would put them last).
# TEST_WORKERS=0 runs serially, in one process (for a debugger, or -x bisection).
TEST_WORKERS ?= 3

# tests/test_slurm.py stands up a real two-node Slurm cluster (tests/slurm_cluster.py)
# from Debian's packages. Run as root (as CI runs), `make test` installs the missing
# ones first; otherwise, or if apt cannot, those tests skip with one line saying why.
SLURM_PACKAGES := slurmctld slurmd slurm-client slurmdbd mariadb-server munge
SLURM_BINARIES := slurmctld slurmd slurmdbd sbatch sacct scontrol mariadbd mariadb-install-db munged

slurm-packages:
	@missing=0; for b in $(SLURM_BINARIES); do PATH="$$PATH:/usr/sbin:/sbin" command -v $$b >/dev/null || missing=1; done; \
	if [ $$missing = 1 ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing $(SLURM_PACKAGES) for tests/test_slurm.py"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q $(SLURM_PACKAGES) >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(SLURM_PACKAGES) >/dev/null 2>&1; } || \
		echo "could not install $(SLURM_PACKAGES): the Slurm tests will skip"; \
	fi

# The 25 slowest tests are listed at the end: the suite's budget is 10 minutes on 2 cores.
test: $(STAMP) slurm-packages
	$(PY) -m pytest -q --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The inner loop: pure and property tests only, no process started (RECOVER_FAST=1
# makes any unmarked test that starts one fail; see tests/conftest.py).
test-fast: $(STAMP)
	RECOVER_FAST=1 $(PY) -m pytest -q -m "not procs and not slow"

# Micro-benchmarks of the hot paths (benchmarks/micro/), serially: pytest-xdist would
# disable them, and two at once would time each other. Each run's JSON is saved under
# results/bench/micro/ (commit the one you want as the next baseline) and compared
# with the last saved run, so a regression shows as a ratio. Not part of `make test`.
BENCH_STORE := file://results/bench/micro
bench: $(STAMP)
	$(PY) -m pytest -q -p no:xdist -p no:randomly benchmarks/micro \
		--benchmark-storage=$(BENCH_STORE) --benchmark-autosave \
		$(if $(wildcard results/bench/micro/*/*.json),--benchmark-compare,) \
		--benchmark-columns=min,median,mean,rounds --benchmark-sort=name

clean:
	rm -rf $(VENV) runs .pytest_cache
