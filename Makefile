# hf_arb developer tasks. `make test` and `make demo` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=

.PHONY: help venv demo-venv lint test test-fast test-min demo bench bench-gpu docs clean

help:
	@echo "make test   - create .venv (torch CPU/GPU wheel, project + test extra) and run the whole suite"
	@echo "make lint   - ruff check . (pyproject.toml [tool.ruff]); .ci/run runs it before make test"
	@echo "make test-min - the lowest supported versions (constraints-min.txt) in their own .venv-min, a quick subset"
	@echo "make demo   - annotate, train tiny SD and Flux pipelines on 2 processes, write pictures (offline); its own"
	@echo "             light install (torch, the project and its demo extra: no ray, spark, JRE or Chromium)"
	@echo "make bench  - run every benchmark side by side with its baseline, write docs/benchmarks.md"
	@echo "make bench-gpu - on a CUDA machine: full-size models, data loading and the CUDA smoke run (benchmarks/bench_gpu.py),"
	@echo "             Wan 2.1 1.3B's step per (W, H, F) bucket against fixed-size clips (benchmarks/bench_gpu_video.py)"
	@echo "make docs   - build the documentation site into site/ (offline, strict: a broken link fails)"
	@echo "             (the venv has the ray and spark extras; a JRE and Chromium, for the report's browser test, are"
	@echo "             installed from the OS packages if missing)"

venv: $(STAMP)

# Re-install only when the requirements change; the constraints file pins the dev/CI set.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 -c constraints.txt
	$(PY) -m pip install -q -e ".[test,plot,tensorboard,ray,spark,demo]" -c constraints.txt
	command -v java >/dev/null || { apt-get update -qq && apt-get install -y -qq default-jre-headless; }
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }
	touch $(STAMP) $(DEMO_STAMP)

# The demo's light install: the full one above includes its extra (and touches its stamp), so a venv made by
# `make test` is reused as is.
demo-venv: $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 -c constraints.txt
	$(PY) -m pip install -q -e ".[demo]" -c constraints.txt
	touch $(DEMO_STAMP)

lint: venv
	$(PY) -m ruff check .

# Three xdist workers on a 2-core machine: with two, the cores sat idle ~25% of the time (workers waiting on a
# shared artifact, a subprocess or a cluster); measured 2026-11-27, the suite took 15 min 13 s instead of 18 min 14 s.
test: venv
	$(PY) -m pytest -n 3 --dist loadgroup $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow" $(PYTEST_ARGS)

# The lowest set: pyproject's lower bounds pinned in constraints-min.txt, in a venv of its own, and the suite's fast
# checks of the families and flags that set the floors (not in .ci/run: the venv build takes minutes).
VENV_MIN ?= .venv-min
MIN_TESTS ?= tests/test_versions.py tests/test_upstream_scripts.py tests/test_flag_audit.py tests/test_family_flux2.py \
	tests/test_family_qwenimage.py tests/test_family_zimage.py tests/test_train_dreambooth.py tests/test_quantization.py
test-min:
	test -x $(VENV_MIN)/bin/python || $(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install -q torch==2.13.0 -c constraints-min.txt
	$(VENV_MIN)/bin/python -m pip install -q -e ".[test]" -c constraints-min.txt
	$(VENV_MIN)/bin/python -m pytest -n 2 -m "not slow" -p no:cacheprovider $(MIN_TESTS) $(PYTEST_ARGS)

demo: demo-venv
	$(PY) scripts/demo.py

bench: venv
	$(PY) benchmarks/run_all.py

# On a CUDA machine: full-size SD 1.5 / SDXL / Flux.1-dev / Qwen-Image steps and the CUDA smoke run (<= 8 min, no
# network); the results go to benchmarks/results/gpu/<card>.json and, through make bench, docs/benchmarks.md
bench-gpu: venv
	$(PY) benchmarks/bench_gpu.py
	$(PY) benchmarks/bench_gpu_video.py

docs: venv
	$(PY) -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) $(VENV_MIN) build site *.egg-info .pytest_cache .hypothesis
