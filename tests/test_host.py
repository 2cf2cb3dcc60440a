"""What this host is: tokq.host reads /proc/cpuinfo in one place, and the CPUs this process
may use (affinity, then a cgroup v1 or v2 CPU quota); workers.device.use_threads
puts torch's process-wide thread count back, also when the block raises; a worker's default id
is its host and device."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from tokq import host
from tokq.workers.device import use_threads, worker_threads

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512_bf16 amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512_bf16 amx_bf16
"""


def _cgroup(tmp_path, proc_lines: str, files: dict[str, str]):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(proc_lines)
    return root, proc


def test_a_cgroup_v2_cpu_quota_caps_the_usable_cpus(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "150000 100000\n",
                                                             "cpu.max": "max 100000\n"})
    assert host.cpu_quota(root, proc) == 1.5  # the process's own cgroup, not the mount's root
    affinity = len(os.sched_getaffinity(0))
    assert host.usable_cpus(root, proc) == min(affinity, 2)  # 1.5 CPUs keep 2 threads busy at most
    (root / "kubepods/pod1/c1/cpu.max").write_text("max 100000\n")
    assert host.cpu_quota(root, proc) is None
    assert host.usable_cpus(root, proc) == affinity


def test_a_cgroup_v1_cfs_quota_caps_the_usable_cpus_and_minus_one_means_none(tmp_path):
    root, proc = _cgroup(tmp_path, "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
                         {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
                          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert host.cpu_quota(root, proc) == 1.0
    assert host.usable_cpus(root, proc) == 1
    (root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert host.cpu_quota(root, proc) is None


def test_a_namespaced_container_reads_its_quota_at_the_mounts_root(tmp_path):
    # With its own cgroup namespace a container sees "0::/" and its limits at the root.
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "400000 100000\n"})
    assert host.cpu_quota(root, proc) == 4.0
    root, proc = tmp_path / "no-cgroup", tmp_path / "no-proc-cgroup"  # macOS, a bare chroot
    assert host.cpu_quota(root, proc) is None
    assert host.usable_cpus(root, proc) == len(os.sched_getaffinity(0))


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


def test_a_workers_default_threads_stay_within_its_cpu_quota():
    assert worker_threads(3, usable=1) == 3  # --threads is taken as given
    assert worker_threads(0, usable=1) == 1  # a 1-CPU quota: one thread, whatever torch would take
    assert worker_threads(0, usable=10_000) == torch.get_num_threads()  # else torch's own default


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
