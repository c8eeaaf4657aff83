# `make run`: the app on the embedded model (`make setup`: requirements.txt alone, what a Space
# installs). `make test`: the whole test suite, with the test tools and the corpus engine
# (requirements-test.txt, requirements-engine.txt) and the peer environment (.venv-bench) first, so
# the tests that make Optimum / CTranslate2 conversions run rather than skip (CI is a fresh
# machine; the app itself never needs .venv-bench).
# `make test-fast`: the unit tier for the edit loop (no slow, browser, peers or ray test; the tiny
# export is built once and kept in test-artifacts/cache/ until the code it comes from changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: setup engine serve test-tools run test test-fast export-fixture bench-venv bench bench-opus clean

# No byte-compiling at install: a test run imports about a fifth of the files pip would compile,
# and Python compiles those on first import. `make -j2 setup bench-venv` makes both environments at once.
PIP_FLAGS := --no-compile

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_FLAGS) -r requirements.txt
	touch $@

# The corpus engine (bench quality, Ray Data) and the test tools: into the same venv, on top of the app's.
engine: $(VENV)/.installed-engine
$(VENV)/.installed-engine: requirements-engine.txt $(VENV)/.installed
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_FLAGS) -r requirements.txt -r requirements-engine.txt
	touch $@

# Ray Serve (`python -m service.serve`): into the same venv, on top of the corpus engine's ray.
serve: $(VENV)/.installed-serve
$(VENV)/.installed-serve: requirements-serve.txt $(VENV)/.installed-engine
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_FLAGS) -r requirements.txt -r requirements-engine.txt -r requirements-serve.txt
	touch $@

test-tools: $(VENV)/.installed-test
$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed-serve
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_FLAGS) -r requirements.txt -r requirements-engine.txt -r requirements-serve.txt -r requirements-test.txt
	touch $@

run: setup
	$(PY) app.py

# Two workers, one per core, each test file on one worker: its module fixtures are built once,
# and the exports both workers need are shared through tests/conftest.py's on-disk cache.
XDIST := -n 2 --dist loadfile
test: test-tools bench-venv
	$(PY) -m pytest $(XDIST) --durations=20

FAST := not slow and not browser and not peers and not ray
test-fast: test-tools
	$(PY) -m pytest -q $(XDIST) -m "$(FAST)"

# The opus-mt-sized random fixture and its export, for benchmarks at real scale.
export-fixture: setup
	$(PY) -m export.fixtures opus-mt-random --out runs/fixtures/opus-mt-random --force
	$(PY) -m export runs/fixtures/opus-mt-random --out exports/opus-mt-random --force

# Benchmark peers (Optimum, CTranslate2) live in their own venv: optimum-onnx needs transformers<4.58.
BENCH_VENV := .venv-bench
bench-venv: $(BENCH_VENV)/.installed
$(BENCH_VENV)/.installed: requirements-bench.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_FLAGS) -r requirements-bench.txt
	touch $@

# The README's tables: the embedded model, then the opus-mt-sized random fixture with peers.
# Speed runs leave out ort_fp32_single_step (the naive baseline: minutes per round at batch 32;
# `python -m bench speed` without --backends times it). Medians of 3 rounds, run round-robin; then
# each target against a peer again as back-to-back pairs of processes (--paired-rounds), which decide it.
# Both time 4 batches of 32: a pair over 2 batches (under a second) swung with this host's noise.
SPEED_BACKENDS := pytorch,ort_fp32_kv_cache,ort_fp16,ort_int8
bench: engine bench-venv
	$(PY) -m bench speed --peers --rounds 3 --quick --throughput-sentences 128 --batch-sizes 32 --backends $(SPEED_BACKENDS) --paired-rounds 10 --out bench-results/embedded
	$(PY) -m bench speed --peers --num-beams 4 --quick --throughput-sentences 128 --batch-sizes 32 --backends $(SPEED_BACKENDS) --rounds 2 --paired-rounds 6 --out bench-results/embedded-beam4
	$(PY) -m bench quality --out bench-results/embedded-quality

runs/fixtures/opus-mt-random/config.json: | setup
	$(PY) -m export.fixtures opus-mt-random --out runs/fixtures/opus-mt-random --force

# At opus-mt size every runtime costs minutes a round: the peers that set the targets (generate(),
# CTranslate2), no length sweep (`python -m bench speed --model ... --peers` runs everything). The beam
# targets are paired; the batch-32 targets are the embedded model's (make bench), so not paired here.
OPUS_PEERS := transformers,ct2_float32,ct2_int8
bench-opus: engine bench-venv runs/fixtures/opus-mt-random/config.json
	$(PY) -m bench speed --model runs/fixtures/opus-mt-random --forced-tokens 40 --quick --batch-sizes 32 --throughput-sentences 32 --sweep '' --backends $(SPEED_BACKENDS) --peers --peer-list $(OPUS_PEERS) --rounds 3 --out bench-results/opus-mt-random
	$(PY) -m bench speed --model runs/fixtures/opus-mt-random --forced-tokens 40 --quick --num-beams 4 --batch-sizes 4 --throughput-sentences 8 --backends $(SPEED_BACKENDS) --peers --peer-list $(OPUS_PEERS) --rounds 3 --paired-rounds 5 --out bench-results/opus-mt-random-beam4

clean:
	rm -rf exports runs test-artifacts .pytest_cache
