# Two commands do all set-up: `make run` and `make test`. Each installs what it needs
# into .venv first; the stamps make a second run skip the installs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q

.PHONY: run test bench clean venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# Runtime: the gateway, the mock fleet and the CLI.
$(VENV)/.stamp-run: pyproject.toml | $(BIN)/python
	$(PIP) -e .
	touch $@

# Tests: runtime plus the test tools.
$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-run
	$(PIP) -e '.[test,bench]'
	touch $@

venv: $(VENV)/.stamp-test

run: $(VENV)/.stamp-run
	$(BIN)/mesh demo

test: $(VENV)/.stamp-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.stamp-test
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
