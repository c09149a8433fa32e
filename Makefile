# Set-up and entry points. `make demo` and `make test` install everything they need first, into the active
# virtualenv when one is (VIRTUAL_ENV set), else into a project .venv made here: a PEP 668 ("externally managed")
# system Python, as on current Debian and Ubuntu, refuses pip installs outside a virtualenv.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
VENV_PYTHON := $(VENV)/bin/python

.PHONY: install demo test bench

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV) || { echo "could not create $(VENV): on Debian/Ubuntu, apt-get install python3-venv" >&2; exit 1; }

install: $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install -q torch==2.13.0   # first: the CPU build; an unpinned torch pulls GBs of CUDA
	$(VENV_PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(VENV)/bin/corolla demo

test: install
	$(VENV_PYTHON) -m pytest

bench: install
	$(VENV_PYTHON) bench/bench_generate.py
