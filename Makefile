# Set-up and entry points. `make demo` and `make test` install everything they need first.
PYTHON ?= python3

.PHONY: install demo test bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0   # first: the CPU build; an unpinned torch pulls GBs of CUDA
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	corolla demo

test: install
	$(PYTHON) -m pytest

bench: install
	$(PYTHON) bench/bench_generate.py
