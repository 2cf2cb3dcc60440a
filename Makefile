# The two commands a new user runs: `make run` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU torch by default: on dev/CI machines this exact version is a local CPU wheel, so no
# multi-GB CUDA build is pulled. Override for a GPU host: make install TORCH_SPEC='torch==2.13.0+cu128'
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-queue proto dashboards bench bench-gpu bench-gateway-cpu clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[test]' "$(TORCH_SPEC)"
	touch $@

run: install
	$(BIN)/tokq up

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Queue semantics again against another Redis server binary (CI: Debian's redis-server).
test-queue: install
	TOKQ_TEST_REDIS_SERVER=$(REDIS_SERVER) $(BIN)/python -m pytest -q tests/test_queue*.py

proto: install
	$(BIN)/python -m tokq.v1.generate

dashboards: install
	$(BIN)/python deploy/grafana/build.py

# Infinity (a baseline of `tokq bench`) lives in its own venv: its extras would downgrade
# packages tokq needs (transformers 4, numpy 1). Its optimum extra also does the ONNX export
# of the ONNX Runtime baselines (optimum needs transformers < 4.58). Best effort: without it
# the benchmark says Infinity was left out, and exports the ONNX model with torch.onnx.
.venv-infinity/bin/infinity_emb:
	$(PYTHON) -m venv .venv-infinity
	.venv-infinity/bin/pip install -q "$(TORCH_SPEC)" 'infinity-emb[server,torch,optimum]==0.0.78'

# Regenerates profiling/RESULTS.md's sections and plots (about 15 minutes on 2 cores).
bench: install
	-$(MAKE) .venv-infinity/bin/infinity_emb
	$(BIN)/python -m tokq.profiling.bench.queue
	$(BIN)/python -m tokq.profiling.bench.runtime
	$(BIN)/python -m tokq.profiling.bench.prefix --threads 1 --write profiling/RESULTS.md
	$(BIN)/python -m tokq.profiling.bench.gateway_cpu run --results-md profiling/RESULTS.md
	$(BIN)/tokq bench --all --out profiling/bench.json --plots profiling/ --results-md profiling/RESULTS.md

# Gateway CPU per single-input call (gateway, worker, Redis, load client) against a bare gRPC
# server, with a py-spy profile of the gateway.
bench-gateway-cpu: install
	$(BIN)/python -m tokq.profiling.bench.gateway_cpu run --profile-dir profiling/gateway-profile \
		--results-md profiling/RESULTS.md

# On a CUDA host (install with TORCH_SPEC='torch==2.13.0+cu128'): `tokq profile` and `tokq bench`
# on the GPU with the bundled MiniLM and a Qwen3-0.6B-shaped random model; writes RESULTS.md's
# "GPU benchmark" section (GPU name, MFU at the profiled budget, throughput vs one-at-a-time).
# Without a GPU it says so and exits 0.
bench-gpu: install
	$(BIN)/python -m tokq.profiling.bench.gpu --results-md profiling/RESULTS.md --out-dir profiling/gpu
	$(BIN)/python -m tokq.profiling.bench.prefix --device cuda --layers 28 --token-budget 8192 --queries 8192 \
		--write profiling/RESULTS.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
