"""How the C kernels are built (workers/kernels/cpu_build.py): rebuilt when their sources change,
correct when built for older x86 CPUs than this one (SSE4.2 only, AVX2), as a worker on such a
machine builds them with -march=native, and loaded without changing how the rest of the process
does floating point."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokq.host import cpu_flags
from tokq.workers.kernels import cpu_attention, cpu_build, cpu_norm

WORKERS = Path(cpu_build.__file__).parent


def test_a_kernel_is_rebuilt_when_its_source_or_a_shared_header_changes(tmp_path):
    for name in ("cpu_norm.c", "cpu_vec.h"):
        (tmp_path / name).write_bytes((WORKERS / name).read_bytes())
    source = tmp_path / "cpu_norm.c"
    first = cpu_build.build_key(source, "cc")
    assert cpu_build.build_key(source, "cc") == first and cpu_build.build_key(source, "gcc") != first
    (tmp_path / "cpu_vec.h").write_text((tmp_path / "cpu_vec.h").read_text() + "\n/* changed */\n")
    second = cpu_build.build_key(source, "cc")
    assert second != first
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert cpu_build.build_key(source, "cc") not in (first, second)


def _check_kernels_against_the_reference() -> None:
    """Both kernels (as ``cpu_build.library`` gives them), fp32 and bf16, against float64. Head
    size 32 is whole vectors at every width; 38 and a row of 100 leave a remainder at each."""
    gen = torch.Generator().manual_seed(0)
    lens = [1, 5, 13, 31, 70]
    cu = torch.tensor([0, *np.cumsum(lens)])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for head_dim in (32, 38):
            q, k, v = (torch.randn(sum(lens), 4, head_dim, generator=gen).to(dtype) for _ in range(3))
            out = cpu_attention.attend(q, k, v, cu, True, 0.2)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                ref = F.scaled_dot_product_attention(*(x[a:b].double().transpose(0, 1) for x in (q, k, v)),
                                                     is_causal=True, scale=0.2).transpose(0, 1)
                torch.testing.assert_close(out[a:b].double(), ref, atol=tol, rtol=tol)
        x, residual = (torch.randn(20, 100, generator=gen).to(dtype) for _ in range(2))
        weight, bias = (torch.randn(100, generator=gen).to(dtype) for _ in range(2))
        torch.testing.assert_close(
            cpu_norm.layer_norm(x, weight, bias, 1e-5, residual=residual).double(),
            F.layer_norm((x + residual).double(), (100,), weight.double(), bias.double(), 1e-5),
            atol=5 * tol, rtol=tol)


@pytest.mark.skipif(platform.machine() != "x86_64" or cpu_build.compiler() is None,
                    reason="x86-64 levels, with a C compiler")
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_the_kernels_built_for_an_older_cpu_give_the_same_results(march, tmp_path, monkeypatch):
    flags = [f for f in cpu_build.FLAGS if not f.startswith("-march")] + [f"-march={march}"]
    libs = {}
    for name in ("cpu_attention", "cpu_norm"):
        built = tmp_path / f"{name}.so"
        cpu_build.compile_library(cpu_build.compiler(), flags, WORKERS / f"{name}.c", built)
        libs[name] = ctypes.CDLL(str(built))
    monkeypatch.setattr(cpu_build, "library", lambda name, extra_flags=(): (libs[name], None))
    lanes = {"x86-64-v2": 4, "x86-64-v3": 8}[march]
    assert cpu_build.vector_lanes("cpu_attention") == cpu_build.vector_lanes("cpu_norm") == lanes
    _check_kernels_against_the_reference()


@pytest.mark.skipif(cpu_build.compiler() is None, reason="needs a C compiler")
@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_the_kernels_give_the_same_results_at_every_vector_width(lanes, monkeypatch):
    """Each width's code (workers/kernels/cpu_vec.h), whatever this CPU's own: wider vectors than the
    registers are lowered by the compiler, slowly but correctly."""
    built = cpu_build.library
    monkeypatch.setattr(cpu_build, "library",
                        lambda name, extra_flags=(): built(name, (*extra_flags, f"-DLANES={lanes}")))
    assert cpu_build.vector_lanes("cpu_attention") == cpu_build.vector_lanes("cpu_norm") == lanes
    _check_kernels_against_the_reference()


@pytest.mark.skipif(cpu_build.compiler() is None, reason="needs a C compiler")
def test_the_kernels_take_the_cpus_own_vector_width():
    """One register a vector: 16-float vectors on an AVX2 CPU made attention ~3.5x slower."""
    flags = cpu_flags()
    if platform.machine() != "x86_64" or not flags:
        pytest.skip("x86-64 with /proc/cpuinfo")
    native = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    assert cpu_build.vector_lanes("cpu_attention") == cpu_build.vector_lanes("cpu_norm") == native


# Loads both kernels as a worker does, then multiplies a subnormal float in numpy and in torch.
SUBNORMALS = """
import numpy as np, torch
from tokq.workers.kernels import cpu_build
for name in ("cpu_attention", "cpu_norm"):
    lib, reason = cpu_build.library(name)
    assert lib is not None, reason
tiny = np.float32(1e-40)  # subnormal: float32's smallest normal is ~1.2e-38
print(float((np.array([tiny]) * np.float32(1.0))[0]),
      float(torch.tensor([1e-40]) * 1.0))
"""


@pytest.mark.slow
@pytest.mark.skipif(cpu_build.compiler() is None, reason="needs a C compiler")
def test_loading_the_kernels_keeps_subnormal_floats_in_the_rest_of_the_process(tmp_path):
    run = subprocess.run([sys.executable, "-c", SUBNORMALS], capture_output=True, text=True,
                         timeout=300, check=True, env={**os.environ, "TOKQ_CACHE_DIR": str(tmp_path)})
    flushed_to_zero = [float(x) == 0.0 for x in run.stdout.split()]
    assert flushed_to_zero == [False, False]  # numpy's, torch's
