# The two commands a new user runs: `make run` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU torch by default: on dev/CI machines this exact version is a local CPU wheel, so no
# multi-GB CUDA build is pulled. Override for a GPU host: make install TORCH_SPEC='torch==2.13.0+cu128'
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each module kept in one: most tests wait on servers, processes
# and timeouts, so two processes finish the suite in ~0.6x the time even on 2 cores.
TEST_PROCS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test test-fast test-queue proto dashboards docs bench bench-gpu bench-gateway-cpu clean

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
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile $(PYTEST_ARGS)

# Every test not marked slow: the quick check while editing (CI runs `make test`, the whole suite).
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# Queue semantics again against another Redis server binary (CI: Debian's redis-server):
# tests/queue/, and the claim-rule tests still at tests/ top.
QUEUE_TESTS := tests/queue
test-queue: install
	TOKQ_TEST_REDIS_SERVER=$(REDIS_SERVER) $(BIN)/python -m pytest -q -n $(TEST_PROCS) --dist loadfile $(QUEUE_TESTS)

proto: install
	$(BIN)/python -m tokq.v1.generate

dashboards: install
	$(BIN)/python deploy/grafana/build.py

# docs/configuration.md from the typed settings in tokq/config.py (a test fails on drift).
docs: install
	$(BIN)/python -m tokq.config_doc --write

# Infinity (a baseline of `tokq bench service`) lives in its own venv: its extras would downgrade
# packages tokq needs (transformers 4, numpy 1). Its optimum extra also does the ONNX export
# of the ONNX Runtime baselines (optimum needs transformers < 4.58). Best effort: without it
# the benchmark says Infinity was left out, and exports the ONNX model with torch.onnx.
.venv-infinity/bin/infinity_emb:
	$(PYTHON) -m venv .venv-infinity
	.venv-infinity/bin/pip install -q "$(TORCH_SPEC)" 'infinity-emb[server,torch,optimum]==0.0.78'

# Regenerates the CPU sections of profiling/results/*.md and their figures (about three hours on 2 cores):
# each `tokq profile` / `tokq bench NAME` with --results-md rewrites its own section, under the command that made it.
RESULTS := profiling/results
bench: install
	-$(MAKE) .venv-infinity/bin/infinity_emb
	$(BIN)/tokq bench queue --json /tmp/bench_queue.json --results-md $(RESULTS)/queue.md
	$(BIN)/tokq profile --device cpu --out /tmp/minilm.json --plot $(RESULTS)/figures/profile-minilm-cpu.png --threads 1 \
		--results-md $(RESULTS)/model.md
	$(BIN)/tokq bench runtime --dtype float32 --results-md $(RESULTS)/model.md
	$(BIN)/tokq bench runtime --num-queries 300 --rounds 3 --token-budgets 1024 --threads 1 --results-md $(RESULTS)/model.md
	$(BIN)/tokq bench dtypes --num-queries 400 --rounds 2 --threads 1 --results-md $(RESULTS)/model.md
	$(BIN)/tokq bench linear --rounds 7 --threads 1,2 --results-md $(RESULTS)/model.md
	$(BIN)/tokq bench prefix --threads 1 --results-md $(RESULTS)/model.md
	$(BIN)/tokq bench gateway-cpu --calls 1000 --rates 60,200 --concurrency 8,64 --rounds 3 \
		--profile-dir $(RESULTS)/gateway-profile --json /tmp/gateway_cpu.json --results-md $(RESULTS)/gateway.md
	$(BIN)/tokq bench http-cpu --calls 600 --rounds 3 --results-md $(RESULTS)/gateway.md
	$(BIN)/tokq bench spread --seconds 6 --concurrency 32 --rounds 3 --json /tmp/spread.json --results-md $(RESULTS)/gateway.md
	$(BIN)/tokq bench hostile --rounds 2 --phase-s 10 --json /tmp/bench_hostile.json --results-md $(RESULTS)/service.md
	$(BIN)/tokq bench shards --results-md $(RESULTS)/queue.md
	$(BIN)/tokq bench crash-recovery --rounds 2 --results-md $(RESULTS)/service.md
	$(BIN)/tokq bench idle-workers --results-md $(RESULTS)/service.md
	$(BIN)/tokq bench service --system tokq-defaults --system one-at-a-time --system onnx --system infinity \
		--system infinity-onnx --start-rate 10 --step-duration-s 3 --out /tmp/bench.json --plots $(RESULTS)/figures/ \
		--results-md $(RESULTS)/service.md --quiet
	$(BIN)/tokq bench service --start-rate 50 --step-duration-s 3 --token-budgets 64,256,1024 \
		--out /tmp/budget_check.json --plots $(RESULTS)/figures/ --results-md $(RESULTS)/service.md --budget-check
	$(BIN)/tokq bench service --system tokq-defaults --system tokq-defaults-t2 --system tokq-defaults-t2 \
		--system tokq-defaults --start-rate 100 --step-duration-s 3 --section 'worker threads' --results-md $(RESULTS)/service.md
	$(BIN)/tokq bench rerank --results-md $(RESULTS)/rerank.md
	$(BIN)/tokq bench bulk --docs 50000 --parts bulk --rounds 1 --results-md $(RESULTS)/bulk.md
	$(BIN)/tokq bench bulk --docs 1200 --parts mixed --results-md $(RESULTS)/bulk.md

# Gateway CPU per single-input call (gateway, worker, Redis, load client) against a bare gRPC
# server, with a py-spy profile of the gateway.
bench-gateway-cpu: install
	$(BIN)/tokq bench gateway-cpu --profile-dir $(RESULTS)/gateway-profile --results-md $(RESULTS)/gateway.md

# On a CUDA host (install with TORCH_SPEC='torch==2.13.0+cu128'): `tokq profile` and `tokq bench
# service` on the GPU with the bundled MiniLM and a Qwen3-0.6B-shaped random model; writes the
# "GPU benchmark" section of profiling/results/gpu.md (GPU name, MFU at the profiled budget,
# throughput vs one-at-a-time), then the shared-prompt bench's GPU section and CUDA graphs
# against eager forwards. Without a GPU each says so and exits 0.
bench-gpu: install
	$(BIN)/tokq bench gpu --results-md $(RESULTS)/gpu.md --out-dir $(RESULTS)/gpu
	$(BIN)/tokq bench prefix --device cuda --layers 28 --token-budget 8192 --queries 8192 --results-md $(RESULTS)/gpu.md
	$(BIN)/tokq bench graphs --results-md $(RESULTS)/gpu.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
