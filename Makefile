# Everything a fresh machine needs: python3 and make. The venv is created on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest demo bench chaos supervisor-chaos rollout clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check orbit_sync tests examples benchmarks
	$(BIN)/ruff format --check orbit_sync tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict orbit_sync

# The suite in parallel processes (pytest-xdist; one per core, at most 4): most of its time is
# spent waiting on loopback sockets, timers and child processes, so two processes on 2 cores
# take about half the time of one. PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= auto
pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 --dist worksteal

# Every supported Python (3.10, 3.11, 3.12 and 3.13): the import/plugin checks and a fast subset
# of the suite on each one `pytest` did not run; a missing supported version is a warning, and
# fails with ORBIT_REQUIRE_ALL_PYTHONS=1, as in CI (scripts/test-versions).
versions: $(STAMP)
	scripts/test-versions

test: lint typecheck pytest versions

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

# Sets up its own venv (benchmarks/.venv: Dramatiq, Celery, py-spy) and redis-server, then runs
# everything in one go (~10 min on 2 cores). BENCH_ARGS=--quick for a small run without peers.
BENCH_PY := benchmarks/.venv/bin/python
bench:
	$(PYTHON) benchmarks/setup_env.py
	$(BENCH_PY) benchmarks/run.py $(BENCH_ARGS)
	$(BENCH_PY) benchmarks/beyond.py $(if $(findstring --quick,$(BENCH_ARGS)),--quick,)

# A Worker with its default settings (reconnect backoff, dial and call timeouts) through a TCP
# proxy with ~90 ms round trips that cuts connections every ~0.3 s on average for 230 s, then
# stops cutting: 1,000 tasks of 0-1.5 s per seed (capacity 16, 3 s leases), with and without
# cuts. Prints per seed the throughput ratio, the longest time without a finished task while
# cutting and the time to all terminal once the cuts stopped; fails when one misses its target
# (ratio >= 0.2, under 10 s, within 30 s) or a guarantee broke.
CHAOS_ARGS ?= --tasks 1000 --rtt 0.09 --mean-cut 0.3 --seeds 1,2,3 --capacity 16 --lease 3 \
	--task-max 1.5 --defaults --cut-for 230 --min-ratio 0.2 --max-gap 10 --max-settle 30
chaos: $(STAMP)
	$(BIN)/python tests/_cutlink_run.py $(CHAOS_ARGS)

# orbit-sync worker --processes 2 recycling every 50 tasks while a random child is SIGKILLed every
# 1-3 s (1,000 tasks), then a handler leaking 1 MB per task under --max-memory-per-child 100
# (2,000 tasks); each prints its figures and fails on any lost, repeated or unbounded thing.
supervisor-chaos: $(STAMP)
	$(BIN)/python tests/_supervisor_chaos.py chaos --tasks 1000 --processes 2 --recycle 50
	$(BIN)/python tests/_supervisor_chaos.py leak --tasks 2000 --limit 100

# A rolling deploy against the mock server in its own process: 2,000 tasks allowed one attempt
# each, 4 worker pods (plain, then supervisors of 2 processes recycled every 50 tasks) each
# replaced 3 times, one after the other (SIGTERM, a new pod). Prints and checks: every task
# SUCCEEDED with 1 attempt and 1 side effect, no lease expired, every pod exits 0, the longest
# gap without a finish during the restarts under 2 lease windows (docs/deploy.md).
ROLLOUT_ARGS ?= --tasks 2000 --pods 4 --rounds 3
rollout: $(STAMP)
	$(BIN)/python benchmarks/rollout.py $(ROLLOUT_ARGS)

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info .mypy_cache .ruff_cache .pytest_cache
