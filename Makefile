# `make run`: the app on the embedded model. `make test`: the whole test suite, with the peer
# environment (.venv-bench) first, so the tests that make Optimum / CTranslate2 conversions run
# rather than skip (CI is a fresh machine; the app itself never needs .venv-bench).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: setup run test export-fixture bench-venv bench bench-opus clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

run: setup
	$(PY) app.py

test: setup bench-venv
	$(PY) -m pytest

# The opus-mt-sized random fixture and its export, for benchmarks at real scale.
export-fixture: setup
	$(PY) -m export.fixtures opus-mt-random --out runs/fixtures/opus-mt-random --force
	$(PY) -m export runs/fixtures/opus-mt-random --out exports/opus-mt-random --force

# Benchmark peers (Optimum, CTranslate2) live in their own venv: optimum-onnx needs transformers<4.58.
BENCH_VENV := .venv-bench
bench-venv: $(BENCH_VENV)/.installed
$(BENCH_VENV)/.installed: requirements-bench.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	touch $@

# The README's tables: the embedded model, then the opus-mt-sized random fixture with peers.
bench: setup bench-venv
	$(PY) -m bench speed --peers --rounds 2 --out bench-results/embedded
	$(PY) -m bench quality --out bench-results/embedded-quality

runs/fixtures/opus-mt-random/config.json: | setup
	$(PY) -m export.fixtures opus-mt-random --out runs/fixtures/opus-mt-random --force

bench-opus: setup bench-venv runs/fixtures/opus-mt-random/config.json
	$(PY) -m bench speed --model runs/fixtures/opus-mt-random --forced-tokens 40 --quick --peers --rounds 3 --out bench-results/opus-mt-random

clean:
	rm -rf exports runs test-artifacts .pytest_cache
