# The two commands of the README. Each one sets up .venv (Python 3.12 + the pinned set) when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test lint setup

setup:
	@scripts/setup_env.sh $(VENV)

## Main job on the embedded default: a tiny noisy GPT trained for a few steps on the shipped corpus.
demo: setup
	$(PY) -m nemo_noise_plugin $(ARGS)

## Lint, the import floors (two wings, no cycles, no upward imports), then the whole test suite (GPU tests skip without CUDA):
## the main suite first, then the tests marked slow (the real SmolLM2 model, 4-rank pipelines, whole CPU runs); each pass
## ends with its 15 slowest tests (--durations=15), so a CI log shows where the time went.
test: setup
	$(PY) -m ruff check nemo_noise_plugin tests benchmarks scripts
	$(PY) scripts/check_import_floors.py
	$(PY) -m pytest -q --durations=15 -m "not slow" $(PYTEST_ARGS)
	$(PY) -m pytest -q --durations=15 -m slow $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check nemo_noise_plugin tests benchmarks scripts
	$(PY) -m ruff format --check nemo_noise_plugin tests benchmarks scripts
