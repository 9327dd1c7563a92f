# `make fit` trains with the defaults on a local Ray; `make test` runs the test suite.
# Both create .venv and install the package (with its test extras) on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: fit test install clean

fit: $(STAMP)
	$(BIN)/python -m raytrain_mnist.fit $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

install: $(STAMP)

# Reinstall whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
