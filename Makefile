# Set-up and entry points. `make demo` and `make test` install everything they need first, into the active
# virtualenv when one is (VIRTUAL_ENV set), else into a project .venv made here: a PEP 668 ("externally managed")
# system Python, as on current Debian and Ubuntu, refuses pip installs outside a virtualenv.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
VENV_PYTHON := $(VENV)/bin/python

.PHONY: install demo test test-all collect bench

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV) || { echo "could not create $(VENV): on Debian/Ubuntu, apt-get install python3-venv" >&2; exit 1; }

install: $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -q torch==2.13.0   # first: the CPU build; an unpinned torch pulls GBs of CUDA
	$(VENV_PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(VENV)/bin/corolla demo

# the default tiers (unit + swarm), then the 15 slowest tests: three pytest workers (pytest-xdist) on 2 cores, each
# taking whole files, as most tests wait on servers, the DHT and timeouts more than they compute (6:34-6:52 against
# 7:40-8:29 for two workers and 12:50 for one, on a quiet machine)
test: install
	$(VENV_PYTHON) -m pytest -n 3 --dist loadfile --durations=15

# everything, `slow` included (the fuzz's thousands of cases, 1,000 churn sessions, the failover matrix, long WAN
# scenarios; `net` tests need root and skip elsewhere): under 40 minutes on 2 cores; one worker, as the scale runs of
# the `slow` tier load the machine themselves
test-all: install
	$(VENV_PYTHON) -m pytest -m "" --durations=30

# collect every test, `slow` included, without running any: an import or parametrization error fails here at once
collect: install
	$(VENV_PYTHON) -m pytest --collect-only -q -m ""

bench: install
	$(VENV_PYTHON) bench/bench_generate.py
