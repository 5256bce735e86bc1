# Two commands: `make test` and `make run`. Both set up .venv on their own.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkline-installed
PIPELINE ?= pipelines/toy_world
ARGS ?=

.PHONY: test run bench explore diagrams clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

run: $(STAMP)
	$(VENV)/bin/chunkline stream-serve $(PIPELINE) $(ARGS)

bench: $(STAMP)
	$(PY) -m bench.engine

explore: $(STAMP)
	$(PY) -m states.explore

diagrams: $(STAMP)
	$(PY) -m states.diagrams

clean:
	rm -rf $(VENV) *.egg-info .hypothesis
