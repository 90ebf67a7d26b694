# The README's quick path: make setup, make train, make test. train and test set up .venv
# by themselves first (scripts/setup_env.sh).
PY := .venv/bin/python
CONFIG ?= configs/quickstart.yaml
PYTEST_ARGS ?=

.PHONY: train test setup
setup:
	@bash scripts/setup_env.sh

train: setup
	$(PY) -m recpipe train --config $(CONFIG)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
