# One-stop set-up: `make demo` and `make test` build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned dev set: torch's CPU build lies on disk on the dev machines; GPU users bring their own torch.
PINS := torch==2.13.0 triton==3.9.0 transformers==5.24.0 megatron-core==0.16.1 \
        pytest==9.2.0 pytest-benchmark==5.3.1 hypothesis==6.170.17 matplotlib==3.11.2 tqdm==4.70.1 numpy==2.4.6

# The GPU machine's versions (Triton 3.6, transformers 5.17) with the CPU torch: the second CI leg
# runs the kernels under that Triton's interpreter and builds them for sm_90 with its compiler.
LEGACY_VENV ?= .venv-legacy
LEGACY_PY := $(LEGACY_VENV)/bin/python
LEGACY_PINS := torch==2.13.0 triton==3.6.0 transformers==5.17.0 megatron-core==0.16.1 \
        pytest==9.2.0 hypothesis==6.170.17 numpy==2.4.6

# Lint tool, outside the test pins (`make test` does not lint); .pre-commit-config.yaml uses the same.
RUFF_PIN := ruff==0.17.6

.PHONY: venv venv-legacy demo test test-legacy test-fast bench lint clean

# The editable install runs with -qq: setuptools prints a notice for every editable install of
# a package-dir layout ("Editable installation ... folders with the same name"); errors still show.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINS)
	$(PY) -m pip install -qq --no-deps -e .
	touch $@

venv: $(VENV)/.installed

$(LEGACY_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(LEGACY_VENV)
	$(LEGACY_PY) -m pip install -q --upgrade pip
	$(LEGACY_PY) -m pip install -q $(LEGACY_PINS)
	$(LEGACY_PY) -m pip install -qq --no-deps -e .
	touch $@

venv-legacy: $(LEGACY_VENV)/.installed

demo: venv
	$(PY) -P -m dynctx demo

test: venv
	bash tests/run_tests.sh $(PY)

# The kernel tests under Triton 3.6: interpreted, then built for sm_90 (marker `build`).
test-legacy: venv-legacy
	TRITON_INTERPRET=1 $(LEGACY_PY) -P -m pytest -q -m interpreter tests/kernels
	$(LEGACY_PY) -P -m pytest -q -m build tests/kernels

# make test's plain tests in one process: no interpreted Triton kernels, no slow tests.
test-fast: venv
	$(PY) -P -m pytest -q -m "not interpreter and not gpu and not slow and not mcore019"

bench: venv
	$(PY) -m pytest bench -q --benchmark-only

lint: venv
	$(PY) -m pip install -q $(RUFF_PIN)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(LEGACY_VENV) build *.egg-info
