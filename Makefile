# `make demo` and `make test` each set up everything they need from nothing:
# bubblewrap (via apt when root), a .venv with torch (CPU build) and legorl, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.legorl-setup
RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo test test-all lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if ! command -v bwrap >/dev/null || ! command -v git >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap git >/dev/null; \
	  else echo "legorl needs bubblewrap and git: sudo apt-get install -y bubblewrap git" >&2; exit 1; fi; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[harness,dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/legorl train --config configs/demo.yaml --run-dir $(RUN_DIR)
	@echo "run directory: $(RUN_DIR)"

test: setup
	$(VENV)/bin/legorl doctor
	$(PY) -m pytest -q -m "not slow"

test-all: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
