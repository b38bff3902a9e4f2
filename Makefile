# One entry point per job. `make setup` once on a fresh machine, then `make test` or `make run EXP=...`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
EXP ?= pkda-dAqk
ARGS ?=
# EXP is an experiment's name (experiments/NAME.yaml) or the path of any experiment file
EXP_FILE = $(if $(or $(findstring /,$(EXP)),$(filter %.yaml %.yml,$(EXP))),$(EXP),experiments/$(EXP).yaml)

# Pinned CPU stack (see ../shared/notes/cpu-ci.md): the CPU torch wheel, the Triton whose
# interpreter runs our kernels, and the libraries the harness uses.
PINS := torch==2.13.0 triton==3.7.1 numpy==2.4.6 scipy==1.17.1 pyyaml==6.0.4 pydantic==2.14.4 \
        jinja2==3.1.6 matplotlib==3.11.2 rich==15.0.0 gitpython==3.2.1 nvtx==0.2.17 pytest==9.2.0 \
        safetensors==0.8.0 playwright==1.65.2 ncu-report==2026.3.1 jsonschema==4.26.0 \
        pytest-timeout==2.4.0 pytest-xdist==3.8.0
# Written when the pinned install succeeded; it is older than the Makefile (the pins) or
# pyproject.toml only when those changed, so every other `make run` / `make test` skips pip.
SETUP_STAMP := $(VENV)/.setup-done

# `harness run` exits 0 GO, 1 NO-GO, 3 INCONCLUSIVE (CI gates on that); any of them is a verdict,
# so the make targets that produce one succeed and say which it was. Any other code is a failure.
VERDICT_CODES := 0 1 3
define as_verdict
rc=0; $(1) || rc=$$?; \
if [[ " $(VERDICT_CODES) " == *" $$rc "* ]]; then \
  echo "make $@: a verdict was produced (harness exit $$rc: 0 GO, 1 NO-GO, 3 INCONCLUSIVE); make succeeds"; \
else echo "make $@: no verdict: harness exited $$rc (messages above)" >&2; exit $$rc; fi
endef

.PHONY: setup test run validate report clean-profile h200-wheels

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(SETUP_STAMP): Makefile pyproject.toml | $(VPY)
	$(VPY) -m pip install -q $(PINS)
	$(VPY) -m pip install -q --no-deps -e .
	@$(VPY) -c "import torch, triton, harness; print('setup ok: torch', torch.__version__, 'triton', triton.__version__)"
	@touch $@

setup: $(SETUP_STAMP)

test: setup
	bash ci/test.sh

run: setup
	@$(call as_verdict,$(VPY) -m harness run $(EXP_FILE) $(ARGS))

validate: setup
	$(VPY) -m harness validate $(EXP_FILE)

report: setup
	@$(call as_verdict,$(VPY) -m harness report $(EXP_FILE) $(ARGS))

# Wheels the H200 image lacks (its python3 is 3.12 with torch/triton/jinja2/scipy/...),
# downloaded here into .whl/ (ignored) and carried with `carry: [".whl"]`.
h200-wheels:
	bash tools/h200-wheels.sh
