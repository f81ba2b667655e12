# One-stop set-up: `make demo` and `make test` build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pinned dev set: torch's CPU build lies on disk on the dev machines; GPU users bring their own torch.
PINS := torch==2.13.0 triton==3.9.0 transformers==5.24.0 megatron-core==0.16.1 \
        pytest==9.2.0 pytest-benchmark==5.3.1 hypothesis==6.170.17 matplotlib==3.11.2 tqdm==4.70.1 numpy==2.4.6

# Lint tool, outside the test pins (`make test` does not lint); .pre-commit-config.yaml uses the same.
RUFF_PIN := ruff==0.17.6

.PHONY: venv demo test test-fast bench lint clean

# The editable install runs with -qq: setuptools prints a notice for every editable install of
# a package-dir layout ("Editable installation ... folders with the same name"); errors still show.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINS)
	$(PY) -m pip install -qq --no-deps -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -P -m dynctx demo

test: venv
	bash tests/run_tests.sh $(PY)

bench: venv
	$(PY) -m pytest bench -q --benchmark-only

lint: venv
	$(PY) -m pip install -q $(RUFF_PIN)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
