"""The gateway's helper threads run SCHED_BATCH, its event loop's thread the default policy
(gateway/helper_threads.py): gRPC's threads no longer preempt the thread every call goes through.
A real gateway process is checked in test_service_end_to_end.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")

# In a child: the function changes the whole process, and pytest's threads are not ours to change.
CHILD = """
import os, threading
from tokq.gateway.helper_threads import yield_to_loop_thread
stop = threading.Event()
started = []
def run():
    started.append(threading.get_native_id())
    stop.wait()
threads = [threading.Thread(target=run) for _ in range(3)]
for t in threads: t.start()
while len(started) < 3: pass
print(yield_to_loop_thread())
late = []
threading.Thread(target=lambda: late.append(os.sched_getscheduler(0))).start()
spawned = []
def spawn():  # a thread started by a helper after the change inherits it
    t = threading.Thread(target=lambda: spawned.append(os.sched_getscheduler(0))); t.start(); t.join()
t = threading.Thread(target=spawn); os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
t.start(); os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)); t.join()
for tid in started:
    print(tid, os.sched_getscheduler(tid) == os.SCHED_BATCH)
print("loop", os.sched_getscheduler(0) == os.SCHED_OTHER)
print("late", late[0] == os.SCHED_OTHER, "spawned", spawned[0] == os.SCHED_BATCH)
stop.set()
"""


def test_every_thread_but_the_callers_becomes_a_batch_thread():
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True,
                         timeout=60).stdout.split("\n")
    assert int(out[0]) >= 3
    assert [line.split()[1] for line in out[1:4]] == ["True"] * 3
    assert out[4] == "loop True"
    assert out[5] == "late True spawned True"



GRPC_CHILD = """
import asyncio, os, threading, grpc
from tokq.gateway.helper_threads import yield_to_loop_thread
async def main():
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield_to_loop_thread()
    policy = {t.native_id: os.sched_getscheduler(t.native_id) for t in threading.enumerate()}
    poller = [t.native_id for t in threading.enumerate() if "_poll_wrapper" in t.name]
    core = [int(n) for n in os.listdir("/proc/self/task")
            if open(f"/proc/self/task/{n}/comm").read().strip() == "event_engine"]
    print(len(poller), all(policy[t] == os.SCHED_BATCH for t in poller))
    print(len(core), all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in core))
    print(os.sched_getscheduler(0) == os.SCHED_OTHER)
    await server.stop(None)
asyncio.run(main())
"""


def test_grpc_s_poller_and_event_engine_threads_yield_to_the_loop_thread():
    out = subprocess.run([sys.executable, "-c", GRPC_CHILD], check=True, capture_output=True, text=True,
                         timeout=60).stdout.split("\n")
    assert out[0] == "1 True", out  # grpc.aio's completion-queue poller
    count, ok = out[1].split()
    assert int(count) >= 1 and ok == "True", out
    assert out[2] == "True", out


def test_the_tokenizer_s_threads_are_batch_threads_however_late_they_start():
    import threading

    from tokq.gateway.tokenize import Tokenizer
    from tokq.model.info import ModelInfo

    tok = Tokenizer(ModelInfo.load(), threads=6)  # 4 threads started at once, 2 when needed
    try:
        barrier = threading.Barrier(6)
        futures = [tok._light.submit(barrier.wait, 30) for _ in range(6)]  # all 6 threads busy at once
        for f in futures:
            f.result(timeout=60)
        lane = tok._large.pool.submit(threading.get_native_id).result(timeout=60)
        ids = [t.native_id for t in tok._light._threads] + [lane]  # this pool's, not another test's
        assert len(ids) == 7
        assert all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in ids)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread (pytest's) is left alone
    finally:
        tok.close()


def test_where_the_policy_is_refused_nothing_changes_and_nothing_fails(monkeypatch):
    import errno

    from tokq.gateway import helper_threads

    def refuse(*_):  # gVisor: EINVAL for every policy but the default
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert helper_threads.yield_to_loop_thread() == 0
    helper_threads.batch_this_thread()
    monkeypatch.setattr(os, "listdir", refuse)  # no /proc
    assert helper_threads.yield_to_loop_thread() == 0
