"""`tokq embed-file` against a stand-in gateway (bulk_fake_gateway.py: every vector known
exactly, failures on cue): output layout and order, failed rows, resuming after kill -9 and
Ctrl-C without embedding a committed row again, a gateway that restarts or stays down, refusing
to mix jobs, bad input, and bounded memory on a large input."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bulk_fake_gateway import DIMS, FakeGateway, vector_of
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
from test_tls_and_api_keys import pki  # noqa: E402, F401 (the fixture: a CA, server and client certificates)

from tokq.bulk.cli import embed_file_command  # noqa: E402
from tokq.bulk.send import MIN_UNITS, START_UNITS, Window  # noqa: E402
from tokq.bulk.store import errors_path, parts_path  # noqa: E402


def write_jsonl(path, n: int, *, start: int = 0, words: int = 12) -> list[str]:
    texts = [f"document {i} " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(i % words)) for i in range(start, start + n)]
    with open(path, "w") as f:
        for i, text in enumerate(texts, start):
            f.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
    return texts


def run(args: list[str]):
    return CliRunner().invoke(embed_file_command, [str(a) for a in args], catch_exceptions=False)


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tokq.cli", "embed-file", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def expected(texts: list[str]) -> np.ndarray:
    return np.stack([vector_of(t) for t in texts])


def committed_parts(output) -> list[str]:
    parts = parts_path(output)
    return sorted(p.name for p in parts.glob("rows-*.arrow")) if parts.exists() else []


def wait_for_parts(output, count: int, proc: subprocess.Popen, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(names := committed_parts(output)) >= count:
            return names
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"fewer than {count} parts committed in {timeout_s} s")


@pytest.fixture
def gateway():
    with FakeGateway() as g:
        yield g


def test_parquet_output_holds_ids_and_vectors_in_input_order(tmp_path, gateway):
    texts = write_jsonl(tmp_path / "in.jsonl", 700)
    out = tmp_path / "out.parquet"
    done = run([tmp_path / "in.jsonl", "--out", out, "--id-field", "id", "--target", gateway.target,
                "--commit-rows", 100])
    assert done.exit_code == 0, done.output
    assert "wrote" in done.output and "700 rows" in done.output
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), DIMS)
    assert table.column("id").to_pylist() == [f"d{i}" for i in range(700)]
    np.testing.assert_array_equal(np.array(table.column("embedding").to_pylist(), np.float32), expected(texts))
    # many inputs a request: far fewer calls than rows
    assert gateway.calls < 700 / 5 and gateway.inputs_seen == 700
    assert not parts_path(out).exists() and not errors_path(out).exists()


def test_row_numbers_npy_and_dimensions(tmp_path, gateway):
    (tmp_path / "in.txt").write_text("".join(f"line {i}\n" for i in range(300)))
    texts = [f"line {i}" for i in range(300)]
    done = run([tmp_path / "in.txt", "--out", tmp_path / "out.parquet", "--target", gateway.target])
    assert done.exit_code == 0, done.output
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["row", "embedding"] and table.column("row").to_pylist() == list(range(300))
    done = run([tmp_path / "in.txt", "--out", tmp_path / "out.npy", "--target", gateway.target, "--dimensions", 4])
    assert done.exit_code == 0, done.output
    vectors = np.load(tmp_path / "out.npy")
    assert vectors.dtype == np.float32 and vectors.shape == (300, 4)
    np.testing.assert_array_equal(vectors, expected(texts)[:, :4])
    record = json.loads((tmp_path / "out.npy.tokq.json").read_text())
    assert record["rows"] == 300 and record["failed"] == 0 and record["job"]["dimensions"] == 4
    again = run([tmp_path / "in.txt", "--out", tmp_path / "out.npy", "--target", gateway.target, "--dimensions", 4])
    assert again.exit_code == 0 and "already complete: 300 rows" in again.output


def test_failed_rows_go_to_the_errors_file_and_the_exit_code_says_so(tmp_path, gateway):
    rows = [{"id": 0, "text": "fine"}, {"id": 1, "text": "TOOLONG text"}, {"id": 2, "text": ""},
            {"id": 3, "text": "UNNAMED fault"}, {"id": 4, "text": "BOOM"}, {"id": 5, "text": "also fine"}]
    lines = [json.dumps(r) for r in rows[:3]] + ["{oops"] + [json.dumps(r) for r in rows[3:]]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    for out in (tmp_path / "out.parquet", tmp_path / "out.npy"):
        done = run([tmp_path / "in.jsonl", "--out", out, "--id-field", "id", "--target", gateway.target])
        assert done.exit_code == 3, done.output
        assert "5 rows failed, listed in" in done.output
        errors = [json.loads(line) for line in errors_path(out).read_text().splitlines()]
        assert [(e["row"], e["id"]) for e in errors] == [(1, 1), (2, 2), (3, None), (4, 3), (5, 4)]
        reasons = [e["reason"] for e in errors]
        assert reasons[0].startswith("INVALID_ARGUMENT: the text is 999 tokens long")
        assert reasons[1] == "line 3: empty text"
        assert reasons[2].startswith("line 4 is not JSON")
        assert reasons[3] == "INVALID_ARGUMENT: the request's inputs are too big"
        assert reasons[4].startswith("INTERNAL: ")
    table = pq.read_table(tmp_path / "out.parquet")  # only the rows embedded
    assert table.column("id").to_pylist() == [0, 5]
    vectors = np.load(tmp_path / "out.npy")  # every row; NaN where it failed
    assert vectors.shape == (7, DIMS)
    assert np.isnan(vectors[1:6]).all() and not np.isnan(vectors[[0, 6]]).any()
    np.testing.assert_array_equal(vectors[6], vector_of("also fine"))
    # with --truncate the over-long row goes through
    done = run([tmp_path / "in.jsonl", "--out", tmp_path / "cut.parquet", "--id-field", "id",
                "--target", gateway.target, "--truncate"])
    assert done.exit_code == 3 and "4 rows failed" in done.output


def test_kill_9_then_rerun_continues_and_never_resends_a_committed_row(tmp_path):
    texts = write_jsonl(tmp_path / "in.jsonl", 3000)
    args = [tmp_path / "in.jsonl", "--id-field", "id", "--commit-rows", 100]
    with FakeGateway(delay_s=0.01) as gateway:
        whole = run(args + ["--out", tmp_path / "whole.parquet", "--target", gateway.target])
        assert whole.exit_code == 0, whole.output
        out = tmp_path / "out.parquet"
        proc = spawn(args + ["--out", out, "--target", gateway.target])
        wait_for_parts(out, 5, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not out.exists()  # nothing half-written passed off as complete
        names = committed_parts(out)
        committed = {i for name in names for i in range(int(name[5:17]), int(name[18:30]))}
        gateway.keep_texts = True
        gateway.texts_seen.clear()
        done = run(args + ["--out", out, "--target", gateway.target])
    assert done.exit_code == 0, done.output
    assert f"{len(committed):,} committed before" in done.output
    resent = set(gateway.texts_seen) & {texts[i] for i in committed}
    assert not resent, f"{len(resent)} committed rows were embedded again"
    assert out.read_bytes() == (tmp_path / "whole.parquet").read_bytes()  # the same file
    assert not parts_path(out).exists()


def test_ctrl_c_stops_cleanly_and_a_rerun_finishes(tmp_path):
    texts = write_jsonl(tmp_path / "in.jsonl", 2000)
    out = tmp_path / "out.npy"
    with FakeGateway(delay_s=0.01) as gateway:
        proc = spawn([tmp_path / "in.jsonl", "--out", out, "--commit-rows", 100, "--target", gateway.target])
        wait_for_parts(out, 3, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "rerun the same command to continue" in err and not out.exists()
        done = run([tmp_path / "in.jsonl", "--out", out, "--commit-rows", 100, "--target", gateway.target])
    assert done.exit_code == 0, done.output
    np.testing.assert_array_equal(np.load(out), expected(texts))


@pytest.mark.slow
def test_gateway_restart_mid_run_is_retried(tmp_path):
    texts = write_jsonl(tmp_path / "in.jsonl", 2000)
    out = tmp_path / "out.parquet"
    gateway = FakeGateway(delay_s=0.01).start()
    port = gateway.port
    proc = spawn([tmp_path / "in.jsonl", "--out", out, "--commit-rows", 100, "--target", gateway.target])
    try:
        wait_for_parts(out, 3, proc)
        gateway.stop()  # calls in flight fail UNAVAILABLE; the job retries with backoff
        time.sleep(1.5)
        gateway = FakeGateway(delay_s=0.01).start(port)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        gateway.stop()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    # a call cut by the gateway's stop ends UNAVAILABLE, or CANCELLED when the server went first
    assert ("UNAVAILABLE" in stderr or "CANCELLED" in stderr) and "retrying" in stderr
    table = pq.read_table(out)
    np.testing.assert_array_equal(np.array(table.column("embedding").to_pylist(), np.float32), expected(texts))


@pytest.mark.slow
def test_target_down_fails_in_one_line_and_a_later_run_resumes(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", 3000)
    out = tmp_path / "out.parquet"
    gateway = FakeGateway(delay_s=0.03)
    gateway.start()
    port = gateway.port
    gateway.stop()
    args = [tmp_path / "in.jsonl", "--out", out, "--commit-rows", 100, "--target", f"127.0.0.1:{port}",
            "--retry-for", 1]
    done = CliRunner().invoke(embed_file_command, list(map(str, args)))
    assert done.exit_code == 1
    last = done.output.strip().splitlines()[-1]
    assert last.startswith(f"embed-file: the gateway at 127.0.0.1:{port} did not answer: no answer for")
    assert "rerun the same command to continue" in last
    assert not out.exists()
    # down mid-run: committed parts are kept, the rerun resumes from them
    gateway = FakeGateway(delay_s=0.03).start(port)
    proc = spawn(args)
    try:
        wait_for_parts(out, 2, proc)
        gateway.stop()
        _, err = proc.communicate(timeout=60)
    finally:
        gateway.stop()
    assert proc.returncode == 1 and "did not answer" in err.strip().splitlines()[-1]
    kept = committed_parts(out)
    assert kept and not out.exists()
    with FakeGateway().start(port) as gateway:
        gateway.keep_texts = True
        done = run(args)
    assert done.exit_code == 0, done.output
    assert "committed before" in done.output and gateway.inputs_seen <= 3000 - 100 * len(kept)


def test_resource_exhausted_is_retried_with_less_in_flight(tmp_path):
    texts = write_jsonl(tmp_path / "in.jsonl", 400)
    refusals = iter(range(5))

    def fail(_texts):
        if next(refusals, None) is not None:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "queue over its token cap, retry later with backoff"
        return None

    with FakeGateway(fail=fail) as gateway:
        done = run([tmp_path / "in.jsonl", "--out", tmp_path / "out.npy", "--target", gateway.target])
    assert done.exit_code == 0, done.output
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expected(texts))


def test_refuses_to_mix_jobs_without_overwrite(tmp_path, gateway):
    write_jsonl(tmp_path / "in.jsonl", 200)
    out = tmp_path / "out.parquet"
    base = [tmp_path / "in.jsonl", "--out", out, "--target", gateway.target]
    assert run(base).exit_code == 0
    again = run(base)
    assert again.exit_code == 0 and "already complete: 200 rows" in again.output
    other = run(base + ["--dimensions", 4])
    assert other.exit_code == 1 and "another job's output (dimensions: 8 there, 4 now)" in other.output
    assert "--overwrite" in other.output
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write(json.dumps({"id": "new", "text": "one more"}) + "\n")
    changed = run(base)
    assert changed.exit_code == 1 and "input_bytes" in changed.output
    replaced = run(base + ["--dimensions", 4, "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert pq.read_table(out).schema.field("embedding").type.list_size == 4
    (tmp_path / "plain.npy").write_bytes(b"someone else's file")
    foreign = run([tmp_path / "in.jsonl", "--out", tmp_path / "plain.npy", "--target", gateway.target])
    assert foreign.exit_code == 1 and "not an output of tokq embed-file" in foreign.output
    assert (tmp_path / "plain.npy").read_bytes() == b"someone else's file"


def test_parts_of_another_job_are_refused_and_a_second_writer_is_locked_out(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", 2000)
    out = tmp_path / "out.parquet"
    with FakeGateway(delay_s=0.02) as gateway:
        args = [tmp_path / "in.jsonl", "--out", out, "--commit-rows", 100, "--target", gateway.target]
        proc = spawn(args)
        try:
            wait_for_parts(out, 1, proc)
            second = run(args)
            assert second.exit_code == 1 and "another tokq embed-file is writing" in second.output
        finally:
            proc.kill()
            proc.wait()
        other = run(args[:-2] + ["--target", gateway.target, "--prompt-name", "query"])
        assert other.exit_code == 1 and "holds the parts of another job (prompt_name: None there" in other.output
        assert committed_parts(out)  # left as they were
        assert run(args + ["--prompt-name", "query", "--overwrite"]).exit_code == 0


def test_bad_input_and_settings_are_clear_errors(tmp_path, gateway):
    write_jsonl(tmp_path / "in.jsonl", 10)
    target = ["--target", gateway.target]
    missing = CliRunner().invoke(embed_file_command, [str(tmp_path / "gone.jsonl"), "--out", str(tmp_path / "o.npy")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    (tmp_path / "in.xml").write_text("<a/>")
    for args, message in [
        ([tmp_path / "in.xml", "--out", tmp_path / "o.npy"], "unknown input format '.xml'"),
        ([tmp_path / "in.jsonl", "--out", tmp_path / "o.csv"], "the output must end in .parquet or .npy"),
        ([tmp_path / "in.jsonl", "--out", tmp_path / "no" / "such" / "o.npy"], "the output's folder must exist"),
        ([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--text-field", "body"], "has no field 'body'"),
        ([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--dimensions", 99],
         "dimensions=99 is out of range: fake-model gives 1..8"),
        ([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--prompt-name", "nope"],
         "unknown prompt name 'nope'; fake-model defines: query"),
    ]:
        done = run(args + target)
        assert done.exit_code == 1, done.output
        assert message in done.output and done.output.startswith("embed-file: ")
        assert len(done.output.strip().splitlines()) == 1
    assert not list(tmp_path.glob("o.*"))  # nothing written for a job that could not start
    with FakeGateway(also_serves=("other-model",)) as several:
        done = run([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--target", several.target])
        assert done.exit_code == 1 and "serves several models (fake-model, other-model): name one with --model" in done.output
        done = run([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy", "--target", several.target,
                    "--model", "fake-model"])
        assert done.exit_code == 0, done.output
    (tmp_path / "bad.csv").write_text("text,id\nfine,1\nbad,2,extra\n")
    done = run([tmp_path / "bad.csv", "--out", tmp_path / "c.npy"] + target)
    assert done.exit_code == 1 and "line 3: expected 2 columns, found 3" in done.output
    assert not (tmp_path / "c.npy").exists()


def test_tls_and_api_key_options_reach_the_gateway(tmp_path, pki):  # noqa: F811 (the fixture)
    texts = write_jsonl(tmp_path / "in.jsonl", 50)
    certs = pki
    server = (certs["server"].read_bytes(), certs["server_key"].read_bytes())
    with FakeGateway(api_key="s3cret", tls=server) as gateway:
        target = ["--target", f"localhost:{gateway.port}", "--tls-ca", certs["ca"]]
        refused = run([tmp_path / "in.jsonl", "--out", tmp_path / "o.npy"] + target)
        assert refused.exit_code == 1 and "UNAUTHENTICATED: missing or unknown API key" in refused.output
        done = CliRunner(env={"TOKQ_API_KEY": "s3cret"}).invoke(
            embed_file_command, list(map(str, [tmp_path / "in.jsonl", "--out", tmp_path / "o.npy"] + target)))
    assert done.exit_code == 0, done.output
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), expected(texts))


def test_plain_progress_lines_say_rows_rate_and_time_left():
    import io

    from tokq.bulk.progress import Progress

    now = [0.0]
    fraction = [0.0]
    out = io.StringIO()
    progress = Progress(lambda: fraction[0], committed_rows=1000, stream=out, clock=lambda: now[0])
    with progress:
        progress.update(0, 0)  # the fraction done before this run: 0
        now[0], fraction[0] = 5.0, 0.1
        progress.update(500, 10_000)  # within 10 s of the last line: nothing printed
        assert out.getvalue() == ""
        now[0], fraction[0] = 12.0, 0.25
        progress.update(500, 24_000)
    assert out.getvalue() == "embed-file: 2,000 rows (25.0%), 2,000 tokens/s, about 36 s left\n"


async def window_round(w: Window, queue_ms: float, inference_ms: float = 10.0, *, waited: bool = True) -> None:
    """A round: a window's worth of 100-token requests (and one more waiting for room), answered."""
    tickets = [await w.acquire(100) for _ in range(w.limit // 100)]
    more = asyncio.ensure_future(w.acquire(100)) if waited else None
    await asyncio.sleep(0)
    for t in tickets:
        w.observe(t, queue_ms, inference_ms)
        w.release(100, t)
    if more is not None:
        w.release(100, await more)


async def test_window_grows_while_work_is_taken_at_once_and_shrinks_when_it_queues():
    w = Window(100)
    assert w.limit == START_UNITS * 100
    await window_round(w, queue_ms=1)  # taken at once, requests waited
    assert w.limit == 600 and w.slow_start  # slow start doubles
    await window_round(w, queue_ms=1, waited=False)
    assert w.limit == 600  # no request waited for room: more room would go unused
    await window_round(w, queue_ms=50)  # queued five forwards
    assert w.limit == 500 and not w.slow_start
    await window_round(w, queue_ms=1)
    assert w.limit == 600  # then one budget at a time
    await window_round(w, queue_ms=10)
    assert w.limit == 600  # queued a forward: held
    w.congested()
    assert w.limit == 300
    w.congested()
    assert w.limit == MIN_UNITS * 100
    w.set_unit(1000)
    assert w.limit == 2000 and w.unit == 1000
    w = Window(100)
    await window_round(w, queue_ms=1)
    assert w.limit == 600
    sent = [await w.acquire(100) for _ in range(3)]
    for t in sent:  # three refusals from one full queue: one halving
        w.congested(t)
    assert w.limit == 300
    w.release(300)
    w.congested(await w.acquire(100))  # refused again after the cut: another halving
    assert w.limit == MIN_UNITS * 100
    w = Window(100)
    await window_round(w, queue_ms=10)  # the first sign of queueing ends slow start
    assert w.limit == 300 and not w.slow_start
    await window_round(w, queue_ms=1)
    assert w.limit == 400


async def test_a_round_is_judged_on_every_request_sent_in_it_and_no_other():
    """Answers to requests sent before the limit changed tell of the old limit, and a round waits
    for its slowest answers: the first back are the ones that queued least."""
    w = Window(100)
    first = [await w.acquire(100) for _ in range(3)]  # round 1: the first window's worth
    for t in first[:2]:
        w.observe(t, 1, 10)
        w.release(100, t)
    late = [await w.acquire(100) for _ in range(2)]  # sent once round 1 was full: in no round
    waiting = asyncio.ensure_future(w.acquire(100))
    await asyncio.sleep(0)
    w.observe(first[2], 1, 10)
    w.release(100, first[2])  # round 1 judged: taken at once, a request waited for room
    assert w.limit == 600 and w.slow_start
    second = [await waiting] + [await w.acquire(100) for _ in range(3)]  # 2 late + 4 in flight
    for t in late:  # taken at once too, but sent at the old limit
        w.observe(t, 0, 10)
        w.release(100, t)
    second += [await w.acquire(100) for _ in range(2)]
    blocked = asyncio.ensure_future(w.acquire(100))
    await asyncio.sleep(0)
    for t in second[:4]:  # the first back did not queue
        w.observe(t, 0, 10)
        w.release(100, t)
    assert w.limit == 600  # not judged before its last answer
    for t in second[4:]:
        w.observe(t, 60, 10)
        w.release(100, t)
    assert w.limit == 600 and not w.slow_start  # queued two forwards on average: held
    w.release(100, await blocked)


async def test_window_bounds_tokens_in_flight():
    w = Window(100)  # 300 tokens
    await w.acquire(200)
    await w.acquire(100)
    blocked = asyncio.ensure_future(w.acquire(50))
    await asyncio.sleep(0.01)
    assert not blocked.done() and w.in_flight == 300
    w.release(100)
    await asyncio.wait_for(blocked, 1)
    assert w.in_flight == 250
    w.release(250)
    await w.acquire(5000)  # larger than the window: goes alone
    assert w.in_flight == 5000


@pytest.mark.parametrize("workers", [1, 4])
async def test_tokens_in_flight_follow_the_workers_that_take_them(workers):
    """Simulated workers (each request holds one for its tokens' time): the window grows until
    the workers are kept busy, and no further than a few budgets past them."""
    from tokq.bulk.send import EmbedOptions, FleetLimits, Sender, fetch_info
    from tokq.client import AsyncClient

    token_s = 2e-4  # ~2 s of simulated forwards at full use
    texts = [f"doc {i} " + "w " * (i % 30) for i in range(600 * workers)]
    with FakeGateway(workers=workers, token_s=token_s, budget=256) as gateway:
        client = AsyncClient(gateway.target)
        try:
            info = await fetch_info(client, EmbedOptions())
            sender = Sender(client, EmbedOptions(), FleetLimits.from_info(info, None))
            start = time.monotonic()
            await sender.embed_rows(texts)
            rate = sender.tokens / (time.monotonic() - start)
        finally:
            await client.close()
    assert rate >= 0.7 * workers / token_s, f"{rate:.0f} tokens/s of {workers / token_s:.0f}"
    # Three budgets a worker keep it busy (one running, one queued, one returning): a few past that.
    assert sender.window.peak <= (3 * workers + 3) * 256, f"{sender.window.peak / 256:.0f} budgets"
    assert gateway.max_in_flight <= 3 * sender.window.peak  # the limit may have shrunk since


@pytest.mark.slow
def test_a_large_input_streams_with_bounded_memory(tmp_path):
    """A 60 MB input through the whole job (reader, requests, parts, output) peaks within a few
    MB of what a 1 MB input of the same rows peaks at."""
    text = " ".join(f"w{k}" for k in range(48))  # ~230 bytes
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    with open(big, "w") as f:
        line = json.dumps({"text": text}) + "\n"
        f.write(line * 300_000)
    with open(small, "w") as f:
        f.write(line * 5_000)
    assert big.stat().st_size > 55e6
    peaks = {}
    with FakeGateway(budget=65_536, max_inputs=2048) as gateway:
        for path in (small, big):
            code = ("import resource, sys\n"
                    "from tokq.cli import main\n"
                    "try:\n    main()\n"
                    "finally:\n    print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n")
            done = subprocess.run([sys.executable, "-c", code, "embed-file", str(path), "--out",
                                   str(tmp_path / f"{path.stem}.npy"), "--target", gateway.target,
                                   "--commit-rows", "8192"], capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr
            peaks[path.stem] = int(done.stderr.rsplit("PEAK", 1)[1]) * 1024
    assert np.load(tmp_path / "big.npy", mmap_mode="r").shape == (300_000, DIMS)
    grew = peaks["big"] - peaks["small"]
    assert grew < 40e6, f"peak RSS grew {grew / 1e6:.0f} MB ({peaks})"
