# One entry point per job. `make setup` once on a fresh machine, then `make test` or `make run EXP=...`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
EXP ?= pkda-dAqk
ARGS ?=

# Pinned CPU stack (see ../shared/notes/cpu-ci.md): the CPU torch wheel, the Triton whose
# interpreter runs our kernels, and the libraries the harness uses.
PINS := torch==2.13.0 triton==3.7.1 numpy==2.4.6 scipy==1.17.1 pyyaml==6.0.4 pydantic==2.14.4 \
        jinja2==3.1.6 matplotlib==3.11.2 rich==15.0.0 gitpython==3.2.1 nvtx==0.2.17 pytest==9.2.0 \
        safetensors==0.8.0 playwright==1.65.2 ncu-report==2026.3.1

.PHONY: setup test run validate report clean-profile h200-wheels

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

setup: $(VPY)
	$(VPY) -m pip install -q $(PINS)
	$(VPY) -m pip install -q --no-deps -e .
	@$(VPY) -c "import torch, triton, harness; print('setup ok: torch', torch.__version__, 'triton', triton.__version__)"

test: setup
	bash ci/test.sh

run: setup
	$(VPY) -m harness run experiments/$(EXP).yaml $(ARGS)

validate: setup
	$(VPY) -m harness validate experiments/$(EXP).yaml

report: setup
	$(VPY) -m harness report experiments/$(EXP).yaml $(ARGS)

# Wheels the H200 image lacks (its python3 is 3.12 with torch/triton/jinja2/scipy/...),
# downloaded here into .whl/ (ignored) and carried with `carry: [".whl"]`.
h200-wheels:
	bash tools/h200-wheels.sh
