"""The gateway CPU benchmark's parts: per-process CPU time from /proc, a measured run of the load
client against a real bare gRPC server, and the py-spy profile summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokq.profiling.bench.gateway_cpu import PySpy, _this, measure, top_frames
from tokq.profiling.bench.proc_cpu import proc_cpu_s, proc_wakeups
from tokq.processes import wait_for_health
from tokq.redis.embedded import free_port

BURN = """
import threading, time, os
def burn():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
threads = [threading.Thread(target=burn) for _ in range(2)]
[t.start() for t in threads]; [t.join() for t in threads]
t = os.times()
print(t.user + t.system, flush=True)
input()
"""


def test_wakeups_count_the_context_switches_of_every_thread_of_a_process():
    child = subprocess.Popen([sys.executable, "-c", WAKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = proc_wakeups(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "slept"
        after = proc_wakeups(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert after - before >= 2 * 50  # two threads, each asleep and woken 50 times


WAKE = """
import threading, time
done, leave = threading.Semaphore(0), threading.Event()
def nap():
    for _ in range(50):
        time.sleep(0.001)
    done.release()
    leave.wait()  # alive while counted: an ended thread's switches leave /proc with it
threads = [threading.Thread(target=nap) for _ in range(2)]
print("ready", flush=True)
input()
[t.start() for t in threads]; done.acquire(); done.acquire()
print("slept", flush=True)
input()
leave.set()
"""


def test_proc_cpu_time_counts_every_thread_of_a_process():
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(child.stdout.readline())  # what the child says it used, all threads
        seen = proc_cpu_s(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert own >= 0.6  # two threads of 0.3 s each (plus start-up)
    assert seen == pytest.approx(own, abs=0.05)  # /proc ticks are 10 ms


@pytest.fixture(scope="module")
def echo_server():
    port = free_port()
    proc = _this("echo-server", "--port", str(port))
    try:
        wait_for_health(f"127.0.0.1:{port}", [proc], 60)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_measure_counts_cpu_of_each_process_over_the_measured_calls(echo_server):
    target, proc = echo_server
    before = proc_cpu_s(proc.pid)
    run = measure(target, {"echo server": proc.pid}, load={"rate": 100}, calls=60, warmup_calls=20, seed=3,
                  workload=None)
    used_overall = proc_cpu_s(proc.pid) - before
    summary = run["summary"]
    assert summary["num_requests"] == summary["num_ok"] == 60
    assert set(run["cpu_ms_per_call"]) == {"echo server", "load client"}
    assert run["cpu_s"]["load client"] > 0
    # Warm-up calls were served too, outside the measured window. Both figures are differences
    # of /proc tick sums in float seconds, so "equal" may differ in the last bit.
    assert 0 <= run["cpu_s"]["echo server"] <= used_overall + 1e-9
    assert run["cpu_ms_per_call"]["echo server"] == pytest.approx(1000 * run["cpu_s"]["echo server"] / 60, abs=1e-3)
    # Each call at 100 req/s wakes the server's threads (gRPC's, then the loop's) at least once.
    assert set(run["wakeups_per_call"]) == {"echo server"} and run["wakeups_per_call"]["echo server"] >= 1


def test_a_closed_loop_run_keeps_its_calls_in_flight_and_counts_them_all(echo_server):
    target, proc = echo_server
    ticks = iter(range(100))
    run = measure(target, {"echo server": proc.pid}, load={"concurrency": 8}, calls=200, warmup_calls=20, seed=5,
                  workload=None, counters=lambda: {"probe": next(ticks)}, connections=1)
    summary = run["summary"]
    assert summary["num_requests"] == summary["num_ok"] == 200
    assert run["cpu_s"]["echo server"] > 0
    assert run["counters"] == {"probe": 1}  # read right before and right after the measured calls


def test_py_spy_profile_of_a_run_shows_the_servers_handler(echo_server, tmp_path):
    target, proc = echo_server
    out = tmp_path / "echo.txt"
    # 1000 calls (~5 s): on a busy machine 400 sometimes left the tiny handler unsampled.
    measure(target, {"echo server": proc.pid}, load={"rate": 200}, calls=1000, warmup_calls=20, seed=4, workload=None,
            while_running=lambda: PySpy(proc.pid, out))
    frames = top_frames(out.read_text(), n=100)
    assert frames["busy_samples"] > 0
    assert any("Echo.Embed" in frame for frame, _ in frames["ours"])


def test_top_frames_leaves_out_waits_and_merges_lines_of_a_function():
    collapsed = "\n".join([
        "thread (1): MainThread;run (asyncio/runners.py:190);_embed (gateway/service.py:10);encode (tokq/queue/wire.py:5) 6",
        "thread (1): MainThread;run (asyncio/runners.py:190);_embed (gateway/service.py:12);sendmsg (libc.so.6) 3",
        "thread (1): MainThread;run (asyncio/runners.py:190);select (selectors.py:468);epoll_wait (libc.so.6) 50",
        "thread (7): tokenize_0;_worker (concurrent/futures/thread.py:81);pthread_cond_timedwait (libc.so.6) 40",
        "thread (8): tokenize_1;_worker (concurrent/futures/thread.py:83);0x7f00 (tokenizers.abi3.so) 1",
    ])
    frames = top_frames(collapsed)
    assert frames["samples"] == 100 and frames["busy_samples"] == 10
    assert dict(frames["threads"]) == {"MainThread": 0.9, "tokenize": 0.1}
    assert dict(frames["python"]) == {"encode (tokq/queue/wire.py)": 0.6, "_embed (gateway/service.py)": 0.3,
                                      "_worker (concurrent/futures/thread.py)": 0.1}
    assert dict(frames["native"]) == {"sendmsg (libc.so.6)": 0.3, "[tokenizers.abi3.so]": 0.1}
    assert dict(frames["ours"]) == {"_embed (gateway/service.py)": 0.9, "encode (tokq/queue/wire.py)": 0.6}
    json.dumps(frames)  # goes into the report as is


def _round(gateway_ms: float, echo_ms: float, errors: dict | None = None, counters: dict | None = None,
           wakeups: tuple[float, float] | None = None) -> dict:
    summary = {"latency_ms": {"p99": 40.0}, "errors": errors or {}}
    woken = ({"wakeups_per_call": {"gateway": wakeups[0]}}, {"wakeups_per_call": {"echo server": wakeups[1]}}) \
        if wakeups else ({}, {})
    return {"tokq": {"cpu_ms_per_call": {"gateway": gateway_ms, "worker": 3.0, "redis": 0.2, "load client": 0.5},
                     "summary": summary, **({"counters": counters} if counters else {}), **woken[0]},
            "echo": {"cpu_ms_per_call": {"echo server": echo_ms, "load client": 0.5}, "summary": {"errors": {}},
                     **woken[1]},
            "gateway_vs_echo": round(gateway_ms / echo_ms, 2)}


def _meta(**extra) -> dict:
    return {"command": "tokq bench gateway-cpu", "started_at": "t0", "finished_at": "t1",
            "machine": {"cpu": "cpu", "num_cpus": 2, "platform": "linux"}, "loadavg_at_start": ["1"],
            "loadavg_at_end": ["2"], "calls": 100, "rounds": 3, **extra}


def test_report_judges_the_target_per_load_on_medians_and_only_without_failed_calls(tmp_path):
    from click.testing import CliRunner

    from tokq.profiling.bench.gateway_cpu import SECTION_START, gateway_cpu_command, markdown_section

    report = {"meta": _meta(rates=[60, 200], concurrency=[64]), "loads": [
        {"rate": 60, "rounds": [_round(0.9, 0.6, wakeups=(9.0, 5.0)), _round(1.1, 0.5, wakeups=(12.0, 7.5)),
                                _round(0.8, 0.5, wakeups=(8.5, 6.0))]},
        {"concurrency": 64, "rounds": [_round(0.4, 0.3)] * 3},
        {"rate": 200, "rounds": [_round(0.5, 0.3, counters={"enqueues": 100, "round_trips": 80}),
                                 _round(0.7, 0.3, counters={"enqueues": 100, "round_trips": 40}),
                                 _round(0.55, 0.25, counters={"enqueues": 100, "round_trips": 30})]}]}
    md = markdown_section(report)
    # per load: gateway median, bare median, median of the within-round ratios (1.67, 2.33, 2.2),
    # verdict, median wake-ups per call (gateway / bare; "-" where a run did not count them),
    # enqueues per round trip over all rounds (300 / 150)
    assert "| 200 req/s | 0.550 | 0.300 | **2.20x** (1.67, 2.33, 2.2) | **met** | - | 2.00 |" in md
    assert "| 60 req/s | 0.900 | 0.500 | **1.60x** (1.5, 2.2, 1.6) | **not met** | 9.0 / 6.0 | - |" in md
    assert "| 64 in flight | 0.400 | 0.300 | **1.33x** (1.33, 1.33, 1.33) | **met** | - | - |" in md
    assert "| 200 req/s | gateway (tokq run) | 0.550 | 0.500, 0.700, 0.550 |" in md
    assert "open loop (Poisson) at each of 60, 200 req/s and closed loop with each of 64 calls in flight" in md
    report["loads"][2]["rounds"][1] = _round(0.5, 0.3, errors={"DEADLINE_EXCEEDED": 4})
    md = markdown_section(report)
    assert "| **not judged: some calls failed** | - | 1.82 | 40, 40, 40 | 0/0, 4/0, 0/0 |" in md
    assert "| 60 req/s | 0.900 | 0.500 | **1.60x** (1.5, 2.2, 1.6) | **not met** | 9.0 / 6.0 |" in md  # as before
    report["loads"] = [{"rate": 60, "rounds": [_round(0.9, 0.3)] * 3}]
    (tmp_path / "r.json").write_text(json.dumps(report))
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n")
    for _ in range(2):
        done = CliRunner().invoke(gateway_cpu_command, ["--from-json", str(tmp_path / "r.json"),
                                                         "--results-md", str(results)])
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.startswith("# Results\n") and text.count(SECTION_START) == 1
    assert "| 60 req/s | 0.900 | 0.300 | **3.00x** (3.0, 3.0, 3.0) | **not met** |" in text
    # a run that recorded its CPU's vector extension has a block of its own beside it
    report["meta"]["machine"]["vector_extension"] = "AVX2"
    (tmp_path / "r.json").write_text(json.dumps(report))
    for _ in range(2):
        done = CliRunner().invoke(gateway_cpu_command, ["--from-json", str(tmp_path / "r.json"),
                                                         "--results-md", str(results)])
        assert done.exit_code == 0, done.output
    text = results.read_text()
    assert text.count(SECTION_START) == 1 and text.count("## Gateway CPU per call\n") == 1
    assert text.count("<!-- tokq bench gateway-cpu (AVX2): start") == 1
    assert text.count("## Gateway CPU per call, AVX2 CPU\n") == 1 and "Machine: cpu (AVX2), 2 CPUs" in text


def test_the_report_says_how_the_client_connected_and_the_workers_budget():
    from tokq.profiling.bench.gateway_cpu import markdown_section

    loads = [{"concurrency": 64, "rounds": [_round(0.4, 0.3)] * 3}]
    md = markdown_section({"meta": _meta(concurrency=[64], client_connections=1, token_budget=1024), "loads": loads})
    assert "from a separate client process over 1 connection; the worker's budget 1,024 tokens, after" in md
    md = markdown_section({"meta": _meta(concurrency=[64], client_connections=4, token_budget=0), "loads": loads})
    assert "over 4 connections; the worker's budget its own (fitted to the latency goal, as under `tokq up`)" in md
    md = markdown_section({"meta": _meta(concurrency=[64]), "loads": loads})  # a run from before: nothing claimed
    assert "from a separate client process, after a warm-up" in md


def test_a_report_from_before_rates_renders_as_its_one_load():
    from tokq.profiling.bench.gateway_cpu import markdown_section

    report = {"meta": _meta(rate=60), "rounds": [_round(0.5, 0.25)] * 3}
    assert "| 60 req/s | 0.500 | 0.250 | **2.00x** (2.0, 2.0, 2.0) | **met** |" in markdown_section(report)


def test_loads_are_parsed_and_bad_ones_refused():
    from click.testing import CliRunner

    from tokq.profiling.bench.gateway_cpu import gateway_cpu_command, parse_levels

    assert parse_levels("60, 200,400", "--rates") == [60.0, 200.0, 400.0]
    assert parse_levels("8,64", "--concurrency", int) == [8, 64]
    assert parse_levels("0", "--rates") == []
    for option, bad in (("--rates", "60,x"), ("--rates", "-5"), ("--concurrency", "2.5"), ("--concurrency", "-1")):
        done = CliRunner().invoke(gateway_cpu_command, [option, bad, "--from-json", __file__])
        assert done.exit_code == 2 and option in done.output, (bad, done.output)
    done = CliRunner().invoke(gateway_cpu_command, ["--rates", "0", "--concurrency", "0"])
    assert done.exit_code == 2 and "nothing to measure" in done.output


def test_the_profile_is_kept_gzipped(tmp_path):
    import gzip

    from tokq.profiling.bench.gateway_cpu import gzip_file

    stacks = tmp_path / "gateway-pyspy.txt"
    stacks.write_text("main;loop;run 7\nmain;loop;poll 3\n")
    packed = gzip_file(stacks)
    assert packed.name == "gateway-pyspy.txt.gz" and not stacks.exists()
    assert gzip.decompress(packed.read_bytes()).decode() == "main;loop;run 7\nmain;loop;poll 3\n"
