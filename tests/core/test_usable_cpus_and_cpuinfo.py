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


def _host(tmp_path, own: str, mounts: list[tuple[str, str, str]], files: dict[str, str]):
    """A fake /proc/self/cgroup (``own``), /proc/self/mountinfo (``mounts``: fstype, root in the
    hierarchy, super options; each mounted at tmp_path/<index>) and cgroup files under them
    ("0/kubepods/cpu.max": mount 0's folder kubepods)."""
    lines = [f"{30 + i} 23 0:{40 + i} {root} {tmp_path / str(i)} rw,relatime - {fstype} {fstype} {options}"
             for i, (fstype, root, options) in enumerate(mounts)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/root rw", *lines]) + "\n")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(own)
    return proc, mountinfo


V2 = [("cgroup2", "/", "rw,nsdelegate")]


def test_a_cgroup_v2_cpu_quota_caps_the_usable_cpus(tmp_path):
    proc, mountinfo = _host(tmp_path, "0::/kubepods/pod1/c1\n", V2, {"0/kubepods/pod1/c1/cpu.max": "150000 100000\n",
                                                                    "0/cpu.max": "max 100000\n"})
    assert host.cpu_quota(proc, mountinfo) == 1.5
    affinity = len(os.sched_getaffinity(0))
    assert host.usable_cpus(proc, mountinfo) == min(affinity, 2)  # 1.5 CPUs keep 2 threads busy at most
    (tmp_path / "0/kubepods/pod1/c1/cpu.max").write_text("max 100000\n")
    assert host.cpu_quota(proc, mountinfo) is None
    assert host.usable_cpus(proc, mountinfo) == affinity


def test_a_limit_on_a_parent_cgroup_counts_and_the_smallest_wins(tmp_path):
    # Docker-in-Docker / kind: the process in a nested "init" cgroup without a limit of its own,
    # the container's limit one level up.
    proc, mountinfo = _host(tmp_path, "0::/init\n", V2, {"0/init/cpu.max": "max 100000\n",
                                                        "0/cpu.max": "200000 100000\n"})
    assert host.cpu_quota(proc, mountinfo) == 2.0
    # systemd: CPUQuota= on a slice, the process in a scope under it; a looser limit above.
    proc, mountinfo = _host(tmp_path / "systemd", "0::/system.slice/app.slice/run.scope\n", V2,
                            {"0/system.slice/cpu.max": "400000 100000\n",
                             "0/system.slice/app.slice/cpu.max": "50000 100000\n",
                             "0/system.slice/app.slice/run.scope/cpu.max": "max 100000\n"})
    assert host.cpu_quota(proc, mountinfo) == 0.5
    assert host.usable_cpus(proc, mountinfo) == 1


def test_a_cgroup_v1_cfs_quota_counts_whatever_the_hierarchy_is_named_and_minus_one_means_none(tmp_path):
    # Docker on cgroup v1 without its own cgroup namespace: its cgroup (/docker/abc) is what is
    # mounted, under a name of the mount's choosing; the quota files are at the mount point.
    v1 = [("cgroup", "/docker/abc", "rw,cpuacct,cpu"), ("cgroup", "/docker/abc", "rw,memory")]
    proc, mountinfo = _host(tmp_path, "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n", v1,
                            {"0/cpu.cfs_quota_us": "100000\n", "0/cpu.cfs_period_us": "100000\n",
                             "1/cpu.cfs_quota_us": "1\n", "1/cpu.cfs_period_us": "100000\n"})  # not cpu's
    assert host.cpu_quota(proc, mountinfo) == 1.0
    assert host.usable_cpus(proc, mountinfo) == 1
    (tmp_path / "0/cpu.cfs_quota_us").write_text("-1\n")
    assert host.cpu_quota(proc, mountinfo) is None
    # The whole hierarchy mounted (the host's view): the process's folder below the mount.
    proc, mountinfo = _host(tmp_path / "host", "3:cpu,cpuacct:/docker/abc\n", [("cgroup", "/", "rw,cpu,cpuacct")],
                            {"0/docker/abc/cpu.cfs_quota_us": "300000\n", "0/docker/abc/cpu.cfs_period_us": "100000\n",
                             "0/cpu.cfs_quota_us": "-1\n", "0/cpu.cfs_period_us": "100000\n"})
    assert host.cpu_quota(proc, mountinfo) == 3.0


def test_a_hybrid_host_reads_the_v1_cpu_hierarchy_and_odd_lines_are_skipped(tmp_path):
    # v1 controllers plus an empty unified tree (this CI machine's layout): the cpu line counts.
    mounts = [("cgroup", "/", "rw,cpu"), ("cgroup2", "/", "rw")]
    proc, mountinfo = _host(tmp_path, "garbage\n1:cpu:/job\n0::/job\n", mounts,
                            {"0/job/cpu.cfs_quota_us": "250000\n", "0/job/cpu.cfs_period_us": "100000\n"})
    mountinfo.write_text(mountinfo.read_text() + "not a mount line\n")
    assert host.cpu_quota(proc, mountinfo) == 2.5
    # No cgroup files at all (macOS, a bare chroot): no quota, the affinity's count.
    proc, mountinfo = tmp_path / "no-proc-cgroup", tmp_path / "no-mountinfo"
    assert host.cpu_quota(proc, mountinfo) is None
    assert host.usable_cpus(proc, mountinfo) == len(os.sched_getaffinity(0))


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


def test_a_workers_default_threads_stay_within_the_cpus_it_may_use():
    with use_threads(4):  # torch's default on a 4-core host
        assert worker_threads(3, usable=1) == 3  # --threads is taken as given
        assert worker_threads(0, usable=2) == 2  # a 2-CPU quota: two threads, not torch's four
        assert worker_threads(0, usable=10_000) == 4  # else torch's own default


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
