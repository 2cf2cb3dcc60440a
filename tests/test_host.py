"""What this host is: tokq.host reads /proc/cpuinfo in one place; workers.device.use_threads
puts torch's process-wide thread count back, also when the block raises; a worker's default id
is its host and device."""

from __future__ import annotations

import platform

import pytest
import torch

from tokq import host
from tokq.workers.device import use_threads

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512_bf16 amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512_bf16 amx_bf16
"""


def test_cpuinfo_gives_the_first_cpus_name_and_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    assert host.cpu_name(path) == "Intel(R) Xeon(R) Platinum 8480+"
    assert host.cpu_flags(path) == {"fpu", "sse", "avx512_bf16", "amx_bf16"}
    assert host.cpuinfo_field("no such field", path) is None


def test_without_cpuinfo_the_name_falls_back_and_there_are_no_flags(tmp_path):
    missing = tmp_path / "absent"
    assert host.cpu_name(missing) == (platform.processor() or platform.machine())
    assert host.cpu_flags(missing) == set()


def test_the_vector_extension_is_the_widest_the_cpu_has():
    assert host.vector_extension({"sse2", "avx2", "avx512f", "avx512_bf16"}) == "AVX-512"
    assert host.vector_extension({"sse2", "avx", "avx2", "fma"}) == "AVX2"
    assert host.vector_extension({"sse2", "sse4_2", "avx"}) == "SSE"
    assert host.vector_extension(set()) == platform.machine()


def test_use_threads_sets_then_restores_even_on_error():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with pytest.raises(RuntimeError):
        with use_threads(target):
            assert torch.get_num_threads() == target
            raise RuntimeError("the block failed")
    assert torch.get_num_threads() == before
    with use_threads(0):  # 0: left as it is
        assert torch.get_num_threads() == before


def test_default_worker_id_is_host_and_device_so_a_restart_keeps_it():
    import socket

    from tokq.workers.worker import default_worker_id

    host = socket.gethostname()
    assert default_worker_id(torch.device("cuda:1")) == f"{host}-cuda1"
    assert default_worker_id(torch.device("cpu")) == f"{host}-cpu"
    # --check --this-host finds default ids by this prefix
    assert default_worker_id("cuda:0").startswith(f"{host}-")
