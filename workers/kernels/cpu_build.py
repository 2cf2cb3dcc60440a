"""The CPU kernels written in C (``workers/kernels/*.c``): compiled with ``-march=native`` on first
use, cached by source, flags, compiler and CPU, loaded through ctypes and run on torch's number of
threads; where they cannot be built, the worker keeps torch's ops (docs/internals.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tokq.host import cpu_flags

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")  # compiling; linking: -shared
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the dtype codes the kernels take


def compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    if os.environ.get("TOKQ_CACHE_DIR"):
        return Path(os.environ["TOKQ_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "tokq"


def compile_library(cc: str, flags, source: Path, out: Path) -> None:
    """Compile ``source`` with ``flags``, then link the shared library ``out`` without them: linking
    with -ffast-math adds crtfastmath.o, which flushes subnormals to zero in the whole process."""
    obj = out.with_suffix(".o")
    subprocess.run([cc, *flags, "-c", "-o", str(obj), str(source)], check=True,
                   capture_output=True, text=True, timeout=120)
    subprocess.run([cc, "-shared", "-o", str(out), str(obj), "-lm"], check=True,
                   capture_output=True, text=True, timeout=120)


def build_key(source: Path, cc: str, flags=FLAGS) -> str:
    """What a build depends on: the source, the headers beside it (cpu_vec.h) and the sources it
    includes (cpu_layers.c), the flags, the compiler and the CPU's feature flags."""
    text = source.read_bytes()
    included = re.findall(rb'^#include "([\w.]+\.c)"', text, re.MULTILINE)
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    headers += b"".join((source.parent / name.decode()).read_bytes() for name in included)
    return hashlib.sha256(text + headers + " ".join(flags).encode() + cc.encode()
                          + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]


@functools.cache
def library(name: str, extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded ``workers/kernels/<name>.c``, None) or (None, why not), built once per
    ``build_key``, so a home shared by different CPUs gets one build per CPU kind. ``extra_flags``
    follow FLAGS: a variant build, for comparisons."""
    source = Path(__file__).with_name(f"{name}.c")
    cc = compiler()
    if cc is None:
        return None, "no C compiler found (cc/gcc)"
    flags = FLAGS + tuple(extra_flags)
    path = cache_dir() / f"{name}-{build_key(source, cc, flags)}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                compile_library(cc, flags, source, built)
                os.replace(built, path)  # atomic: concurrent workers never load half a file
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()
            first_error = next((line for line in detail if "error" in line), detail[-1:] or "")
            return None, f"building {source.name} failed: {first_error}"
    try:
        return ctypes.CDLL(str(path)), None
    except OSError as exc:
        return None, f"loading {path} failed: {exc}"


def unavailable_reason(name: str, what: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``what`` (the kernel in ``workers/<name>.c``) cannot run here, or None."""
    if device.type != "cpu":
        return f"{what} runs on CPU (have {device})"
    if dtype not in DTYPES:
        return f"{what} takes float32 or bfloat16 (have {dtype})"
    return library(name)[1]


def function(name: str, symbol: str, argtypes: tuple, extra_flags: tuple[str, ...] = ()) -> ctypes._CFuncPtr:
    """``symbol`` of the built ``name`` (``library``), typed; raises with the reason when it
    cannot be had."""
    lib, reason = library(name, tuple(extra_flags))
    if lib is None:
        raise RuntimeError(reason)
    return _typed(lib, symbol, argtypes)


def vector_lanes(name: str, extra_flags: tuple[str, ...] = ()) -> int:
    """Floats per vector the built ``name`` uses (workers/kernels/cpu_vec.h: the CPU's register width)."""
    return function(name, "tokq_vector_lanes", (), extra_flags)()


@functools.cache
def _typed(lib: ctypes.CDLL, symbol: str, argtypes: tuple) -> ctypes._CFuncPtr:
    """Typed once per loaded library, not on every call (a kernel runs ~20 times a forward)."""
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="cpu-kernel")


def run_parts(fn, args_of_part: list[tuple]) -> list[int]:
    """``fn(*args)`` for each part: the first on the caller's thread, the rest on the pool
    meanwhile. Returns their return codes (none for no parts)."""
    if not args_of_part:
        return []
    futures = [_pool(torch.get_num_threads()).submit(fn, *args) for args in args_of_part[1:]]
    return [fn(*args_of_part[0])] + [f.result() for f in futures]


def even(n: int, parts: int) -> list[tuple[int, int]]:
    """[first, last) ranges splitting ``n`` into ``parts`` about equal ones (none empty)."""
    edges = [n * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]
