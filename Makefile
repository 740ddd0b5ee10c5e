# Two set-up-and-go targets: `make demo` (the main job) and `make test` (every test).
# Each creates .venv on first use and installs what it needs; later runs reuse it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python

# The suite runs on parallel workers (pytest-xdist): most of its time is real training runs that
# wait on their processes, so more workers than cores keep both cores busy.
TEST_WORKERS ?= 4

.PHONY: demo test test-fast bench clean browser clickhouse prometheus

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# the dashboard's browser tests (tests/web) drive Debian's chromium through Playwright, with no
# browser download: installed here when missing and this user may (root, as on CI); elsewhere
# those tests are skipped and say why
browser:
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi

# the ClickHouse store's tests (tests/support/clickhouse.py) start Debian's clickhouse-server from a
# private directory: installed here like the browser, with a policy-rc.d that keeps the package
# from starting a default server
clickhouse:
	@if [ ! -x /usr/sbin/clickhouse-server ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clickhouse-server clickhouse-client >/dev/null; fi

# the Prometheus test (tests/server/test_metrics.py) lets Debian's prometheus scrape a live run
prometheus:
	@if ! command -v prometheus >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; }; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; fi

# The suite starts ~800 Python processes. Each loads stepwatch from its bytecode cache, and each
# pytest worker the test modules with their asserts already rewritten, only where Python may write
# those caches (__pycache__/, ignored by git): PYTHONDONTWRITEBYTECODE, set on some images, is
# unset for the suite (with it, on a clean clone, every process compiles stepwatch again, 0.1 s
# each, and each worker rewrites every test module, 7 s).
test: $(VENV)/.installed browser clickhouse prometheus
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=20

# the inner loop: no process started, no model trained (the tests marked `real` stay out), and
# property tests on a fifth of their examples
test-fast: $(VENV)/.installed
	PYTHONDONTWRITEBYTECODE= STEPWATCH_TESTS_FAST=1 HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-fast} $(PY) -m pytest -q -n 2 -m "not real" --durations=10

bench: $(VENV)/.installed
	$(PY) bench/bench_sink_write.py
	$(PY) bench/bench_load.py
	$(PY) bench/bench_capture_overhead.py
	$(PY) bench/bench_capture_footprint.py
	$(PY) bench/bench_training_overhead.py --configs small large
	$(PY) bench/bench_step_instructions.py
	$(PY) bench/bench_snapshot_spool.py
	$(PY) bench/bench_ingest.py
	$(PY) bench/bench_launcher.py
	$(PY) bench/bench_dashboard.py

clean:
	rm -rf $(VENV) stepwatch_runs .pytest_cache .hypothesis
