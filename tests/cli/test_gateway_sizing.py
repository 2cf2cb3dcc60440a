"""How many gateway processes, and tokenizer threads each, `tokq up` starts: from the CPUs this
host lets it use and what its workers and embedded Redis leave (tokq.up.size_front_end), and
the command line it gives the gateway (its children stood in for)."""

from __future__ import annotations

import signal

import pytest
from click.testing import CliRunner

from tokq import up
from tokq.redis.embedded import free_port
from tokq.up import (GPU_WORKER_CPUS, MAX_GATEWAY_PROCS, REDIS_CPUS, FrontEnd, auto_gateway_procs, size_front_end,
                     threads_per_worker)


@pytest.mark.parametrize("cpus, workers, redis, expected", [
    (16, 1, True, FrontEnd(14, 1)),  # an H100 host's 16 CPUs: every CPU the worker and Redis leave
    (16, 1, False, FrontEnd(15, 1)),  # Redis elsewhere (--redis-url)
    (16, 2, True, FrontEnd(13, 1)),
    (8, 1, True, FrontEnd(6, 1)),
    (4, 1, True, FrontEnd(2, 1)),
    (2, 1, True, FrontEnd(1, 1)),  # nothing left: one process all the same
    (1, 4, True, FrontEnd(1, 1)),
    (128, 8, True, FrontEnd(MAX_GATEWAY_PROCS, 1)),  # 119 left, 64 processes at most
    (256, 1, False, FrontEnd(MAX_GATEWAY_PROCS, 3)),  # 255 left: the rest tokenize
])
def test_with_gpu_workers_the_gateway_takes_a_process_per_cpu_left(cpus, workers, redis, expected):
    assert size_front_end(cpus, workers, on_gpu=True, embedded_redis=redis) == expected


@pytest.mark.parametrize("cpus, workers, threads, expected", [
    (16, 1, 15, FrontEnd(1, 1)),  # tokq up's own split leaves one CPU, shared with Redis
    (16, 4, 3, FrontEnd(1, 3)),  # 4 x 3 threads leave 3 of the 15
    (16, 1, 4, FrontEnd(1, 11)),  # TOKQ_THREADS=4
    (2, 1, 1, FrontEnd(1, 1)),
    (8, 2, 16, FrontEnd(1, 1)),  # oversubscribed workers leave none
])
def test_with_cpu_workers_one_process_tokenizes_on_what_their_threads_leave(cpus, workers, threads, expected):
    assert size_front_end(cpus, workers, on_gpu=False, worker_threads=threads) == expected


def test_an_operators_process_count_splits_the_cpus_left_between_them():
    assert size_front_end(16, 1, on_gpu=True, procs=4) == FrontEnd(4, 3)
    assert size_front_end(16, 1, on_gpu=False, worker_threads=8, procs=2) == FrontEnd(2, 3)
    assert size_front_end(2, 1, on_gpu=True, procs=8) == FrontEnd(8, 1)


@pytest.mark.parametrize("on_gpu", [True, False])
def test_the_rule_over_cpu_and_worker_counts(on_gpu):
    for workers in (1, 2, 3, 8, 16):
        last = FrontEnd(1, 1)
        for cpus in range(1, 257):
            threads = threads_per_worker(workers, cpus)
            front = size_front_end(cpus, workers, on_gpu=on_gpu, worker_threads=threads)
            assert 1 <= front.procs <= MAX_GATEWAY_PROCS and front.tokenize_threads >= 1
            assert front.procs >= last.procs
            used = workers * (GPU_WORKER_CPUS if on_gpu else threads) + REDIS_CPUS
            if cpus > used:  # never more than the CPUs left, and all of them up to the process cap
                assert front.procs * front.tokenize_threads <= cpus - used
                assert front.procs * (front.tokenize_threads + 1) > cpus - used
            if not on_gpu:
                assert front.procs == 1
            last = front
    # more GPU workers leave fewer CPUs
    assert [size_front_end(32, w, on_gpu=True).procs for w in (1, 2, 4, 8)] == [30, 29, 27, 23]


def test_auto_gateway_procs_asks_torch_only_for_device_auto():
    def cuda():
        return True

    def no_cuda():
        return False

    def never():
        raise AssertionError("CUDA looked up for an explicit device")

    assert auto_gateway_procs("cpu", 64, has_cuda=never) == 1  # CPU workers need the cores
    assert auto_gateway_procs("auto", 16, has_cuda=no_cuda) == 1
    assert auto_gateway_procs("auto", 16, has_cuda=cuda) == 14  # not 4: every CPU left
    assert auto_gateway_procs("cuda:1", 16, has_cuda=never, workers=2, embedded_redis=False) == 14
    assert [auto_gateway_procs("cuda", n, has_cuda=never) for n in (2, 8, 12, 64)] == [1, 6, 10, 62]


# -- tokq up's use of it, its children stood in for ---------------------------------------------------

class Child:
    returncode = 0

    def poll(self):
        return None


class Redis:
    url = "redis://:pw@127.0.0.1:1/0"
    running = True

    def __init__(self, **_):
        pass

    def start(self):
        return self

    def close(self):
        pass


@pytest.fixture
def started(monkeypatch):
    """Runs `tokq up ARGS` on a host of ``cpus`` CPUs until it would wait for readiness; returns
    the command lines of the gateway and the workers it started."""
    spawned: list[list[str]] = []

    def spawn(args, env):
        spawned.append(args)
        return Child()

    def ready(*_, **__):
        raise KeyboardInterrupt  # stop there, as Ctrl-C would

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    monkeypatch.setattr(up, "_spawn", spawn)
    monkeypatch.setattr(up, "_wait_ready", ready)
    monkeypatch.setattr(up, "stop_all", lambda procs: None)
    monkeypatch.setattr(up, "EmbeddedRedis", Redis)
    for name in ("TOKQ_GATEWAY_PROCS", "TOKQ_TOKENIZE_THREADS", "TOKQ_THREADS", "TOKQ_DEVICE", "TOKQ_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, cpus: int, cuda: bool = False) -> tuple[list[str], list[list[str]]]:
        spawned.clear()
        monkeypatch.setattr(up, "usable_cpus", lambda: cpus)
        monkeypatch.setattr(up, "cuda_present", lambda: cuda)
        result = CliRunner().invoke(up.up_command, ["--port", str(free_port()), "--http-port", "0",
                                                    "--metrics-port", "0", *args])
        assert result.exit_code == 0, result.output
        gateway, *workers = spawned
        return gateway, workers

    yield run
    for sig, handler in handlers.items():  # tokq up ignores stop signals once stopping
        signal.signal(sig, handler)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_tokq_up_on_a_gpu_host_starts_a_gateway_process_per_cpu_left(started):
    gateway, workers = started(cpus=16, cuda=True)
    assert gateway[0] == "gateway" and len(workers) == 1
    assert flag(gateway, "--procs") == "14" and flag(gateway, "--tokenize-threads") == "1"
    gateway, workers = started("--workers", "2", "--device", "cuda", cpus=32)
    assert flag(gateway, "--procs") == "29" and len(workers) == 2


def test_tokq_up_with_cpu_workers_starts_one_gateway_process(started):
    gateway, (worker,) = started(cpus=16)
    assert flag(gateway, "--procs") == "1" and flag(gateway, "--tokenize-threads") == "1"
    assert flag(worker, "--threads") == "15"


def test_tokq_up_splits_what_tokq_threads_leaves_and_keeps_an_operators_choices(started, monkeypatch):
    monkeypatch.setenv("TOKQ_THREADS", "4")
    gateway, _ = started(cpus=16)
    assert flag(gateway, "--procs") == "1" and flag(gateway, "--tokenize-threads") == "11"
    monkeypatch.delenv("TOKQ_THREADS")
    gateway, _ = started("--gateway-procs", "4", "--device", "cuda", cpus=16)
    assert flag(gateway, "--procs") == "4" and flag(gateway, "--tokenize-threads") == "3"
    monkeypatch.setenv("TOKQ_TOKENIZE_THREADS", "2")  # reaches the gateway in its environment
    gateway, _ = started("--device", "cuda", cpus=16)
    assert flag(gateway, "--procs") == "14" and flag(gateway, "--tokenize-threads") is None
