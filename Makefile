# Every target installs what it needs first (a local .venv from pyproject.toml), and the ones
# that need Redis run under scripts/with-redis, which starts a private redis-server when none
# answers at SAGA_REDIS_URL and stops it afterwards.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
RUNS ?= 300

.PHONY: install demo test lint bench worker flower clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

install: $(INSTALLED)

demo: $(INSTALLED)
	scripts/with-redis $(BIN)/python -m tasks.demo

test: $(INSTALLED)
	scripts/with-redis $(BIN)/python -m pytest

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(INSTALLED)
	scripts/with-redis $(BIN)/python benchmarks/overhead.py --runs $(RUNS)

worker: $(INSTALLED)
	$(BIN)/celery -A tasks.app worker -E --loglevel INFO

flower: $(INSTALLED)
	$(BIN)/celery -A tasks.app flower

clean:
	rm -rf $(VENV) .demo-data .pytest_cache .mypy_cache .ruff_cache *.egg-info
