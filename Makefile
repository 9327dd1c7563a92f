# `make fit` trains with the defaults on a local Ray; `make test` runs the test suite (CI's
# gate); `make test-fast` runs its unit tests only, the ones marked slow left out.
# Both create .venv and install the package (with its test extras, MLflow, export and s3,
# which the suite exercises) on first use.
# `make gpu-bundle` packs what the offline GPU machine needs (docs/gpu.md).

PYTHON ?= python3

# The venv's bytecode is written as each module is first imported, Python's default. Where
# PYTHONDONTWRITEBYTECODE is set (CI's image sets it), every new process, each Ray worker
# among them, would compile torch and Ray again; compiling all of site-packages at install
# instead takes longer than the whole install (CONTRIBUTING.md, Timing).
unexport PYTHONDONTWRITEBYTECODE

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: fit test test-fast install clean gpu-bundle

# What a GPU machine without Ray or internet needs (docs/gpu.md): the Ray wheels for its
# Python 3.12 (at most 48 MiB) and full MNIST as its four .gz files, both in ignored folders
# that the device tool carries with the checkout.
SHARED    ?= ../shared
GPU_WHEELS := build/gpu-wheels
MNIST_GZ   := data/mnist-gz/MNIST/raw
MNIST_FILES := train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte \
               t10k-labels-idx1-ubyte

fit: $(STAMP)
	$(BIN)/python -m raytrain_mnist.fit $(ARGS)

# Two pytest-xdist workers, one work unit per xdist group (tests/conftest.py: in parallel),
# sent in the order collected.
PARALLEL := -n 2 --dist loadgroup --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/python -m pytest $(PARALLEL) $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow" $(ARGS)

install: $(STAMP)

# Reinstall whenever pyproject.toml or this recipe changes. uv installs what pip would, from the
# same index within the same bounds (pyproject.toml's), fetching and unpacking on every core
# where pip unpacks torch's 5 GB of CUDA wheels on one (CONTRIBUTING.md, Timing). It goes into
# the venv itself; the README's by-hand route is plain pip.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev,mlflow,export,s3]'
	touch $(STAMP)

gpu-bundle: $(GPU_WHEELS)/wheels.tar.xz $(MNIST_FILES:%=$(MNIST_GZ)/%.gz)
	@du -ch $^ | tail -n 1

$(GPU_WHEELS)/wheels.tar.xz: pyproject.toml $(STAMP)
	$(BIN)/python $(SHARED)/tools/gpu_wheelhouse.py --out $(GPU_WHEELS) --python-version 3.12 \
		--project . $(if $(GPU_CONSTRAINTS),--constraints $(GPU_CONSTRAINTS))

$(MNIST_GZ)/%.gz: $(SHARED)/data/mnist/MNIST/raw/%
	@mkdir -p $(MNIST_GZ)
	gzip -9 -n -c $< > $@.tmp && mv $@.tmp $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
