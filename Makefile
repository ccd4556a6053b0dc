# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment and installs what is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench-smoke

# The hf extra (transformers, and accelerate for its Trainer) in a second install: pip cannot resolve
# it together with litgpt's pin of huggingface-hub (pyproject.toml says why); the tests of
# transformers models need it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q 'transformers==5.17.0' 'accelerate==1.16.0'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m thunder_memopt report

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --durations=15
