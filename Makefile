# `make demo` and `make test` create .venv on first use: torch==2.13.0 first (the local CPU
# wheel; the project's torch range then installs nothing more), then the project itself.
# (Not --no-compile: with PYTHONDONTWRITEBYTECODE set, as on these machines, every process
# would then compile torch's modules again at each start.)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flower-shard demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q --durations=30 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check flower_shard tests bench

bench: $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,bench]'
	$(VENV)/bin/python bench/overhead.py
	$(VENV)/bin/python bench/multitier.py

clean:
	rm -rf $(VENV) runs .pytest_cache
