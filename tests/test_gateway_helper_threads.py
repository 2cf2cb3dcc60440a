"""The gateway's helper threads run SCHED_BATCH, its event loop's thread the default policy
(gateway/helper_threads.py): gRPC's threads no longer preempt the thread every call goes through.
A real gateway process is checked in test_service.py."""

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

