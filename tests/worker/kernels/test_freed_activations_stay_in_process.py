"""Freed activations stay in the process (workers/kernels/cpu_memory.py): once a CPU engine is loaded,
a forward run again faults no new pages."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Minor page faults per forward of a ~500-token batch of the bundled model, after a warm-up:
# the fewest of 6 forwards, since a one-off growth of the heap (~2 MiB, ~500 faults) can land in
# any one of them, and judged against the same count without the fix (~11,600 here): one fresh-
# clone run on a loaded machine read 185 with the fix (a median; 0 in every run before and since,
# cause not found), which a fixed ceiling of 50 failed though the fix saved 98%. Both runs start with glibc's mmap threshold held at its initial 128 KiB, so
# every large block is mmap'ed and unmapped and, without the fix, every forward faults thousands
# of pages on any machine. Under plain defaults glibc's own heuristics (its moving threshold)
# can keep a batch this size by themselves: on CI's machine they did, and the test failed.
MEASURE = """
import resource, numpy as np, torch
from tokq.batch import PackedBatch
from tokq.workers.kernels import cpu_memory
from tokq.workers.engine import Engine
torch.set_num_threads(1)
if {disabled}:  # glibc left as it starts
    cpu_memory.keep_freed_memory = lambda: False
engine = Engine.load(None, device="cpu", dtype="float32")
batch = PackedBatch.pack([np.arange(1000, 1000 + n) for n in [12, 30, 7, 90, 25] * 3])
engine.embed(batch)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.embed(batch)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def _faults_per_forward(disabled: bool) -> float:
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.mmap_threshold=131072"]))
    env = {**os.environ, "GLIBC_TUNABLES": tunables}
    run = subprocess.run([sys.executable, "-c", MEASURE.format(disabled=disabled)], check=True,
                         capture_output=True, text=True, timeout=300, env=env)
    return float(run.stdout.split()[-1])


@pytest.mark.slow
def test_a_cpu_engine_keeps_freed_memory_for_the_next_forward():
    without = _faults_per_forward(disabled=True)
    assert without > 500  # fresh pages each time
    assert _faults_per_forward(disabled=False) < without / 20
