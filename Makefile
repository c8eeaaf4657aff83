# `make run`: the app on the embedded model. `make test`: the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: setup run test export-fixture clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

run: setup
	$(PY) app.py

test: setup
	$(PY) -m pytest

# The opus-mt-sized random fixture and its export, for benchmarks at real scale.
export-fixture: setup
	$(PY) -m export.fixtures opus-mt-random --out runs/fixtures/opus-mt-random --force
	$(PY) -m export runs/fixtures/opus-mt-random --out exports/opus-mt-random --force

clean:
	rm -rf exports runs test-artifacts .pytest_cache
