"""The sweep behind `tokq profile`: forward passes timed on a geometric grid of batch token counts (wall
clock on CPU, CUDA events on a GPU), stopping past ``stop_ms`` or out of memory (reported, not raised)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from tokq.batch import PackedBatch
from tokq.workers.errors import is_out_of_memory, release_memory  # noqa: F401 - re-exported


@dataclass(frozen=True)
class SweepConfig:
    min_tokens: int = 16
    max_tokens: int = 16384
    points_per_doubling: int = 2  # 2 = a sqrt(2) grid step
    warmup_runs: int = 1  # untimed runs per point (allocations, kernel selection)
    min_repeats: int = 3
    max_repeats: int = 50
    target_s_per_point: float = 1.0  # keep timing a point until this much time is spent
    stop_ms: float = 2000.0  # no larger batches once one takes longer than this

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.points_per_doubling < 1 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise ValueError("need points_per_doubling >= 1 and 1 <= min_repeats <= max_repeats")


def token_grid(min_tokens: int, max_tokens: int, points_per_doubling: int = 2) -> list[int]:
    """Geometric grid from min_tokens to max_tokens (both included), rounded to whole tokens."""
    num_steps = int(np.floor(np.log2(max_tokens / min_tokens) * points_per_doubling + 1e-9))
    grid = np.rint(min_tokens * 2.0 ** (np.arange(num_steps + 1) / points_per_doubling)).astype(int)
    return sorted(set(grid.tolist()) | {max_tokens})


@dataclass(frozen=True)
class Point:
    num_tokens: int
    num_seqs: int
    max_seqlen: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    num_repeats: int
    gflop_per_s: float | None = None  # achieved model FLOP rate, when the model can count its FLOPs

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / (self.median_ms / 1000.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class SweepResult:
    points: list[Point] = field(default_factory=list)
    stopped_reason: str | None = None  # why the grid was cut short; None when it ran to the end
    out_of_memory_tokens: int | None = None


class WallTimer:
    """Times a call by a host clock (seconds -> ms); the clock is injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock

    def time_ms(self, fn: Callable[[], object]) -> float:
        start = self.clock()
        fn()
        return (self.clock() - start) * 1000.0


class CudaEventTimer:
    """Times a call by CUDA events on the current stream (embed() syncs, so host packing counts too)."""

    def __init__(self, device: object) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)

    def time_ms(self, fn: Callable[[], object]) -> float:
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        with cuda.device(self.device):
            start.record()
            fn()
            end.record()
            end.synchronize()
        return float(start.elapsed_time(end))


def timer_for(device: object) -> WallTimer | CudaEventTimer:
    return CudaEventTimer(device) if str(device).startswith("cuda") else WallTimer()


def _needs_more(times_ms: list[float], config: SweepConfig) -> bool:
    """The repeat rule: at least min_repeats and target_s_per_point of timed runs, at most max_repeats."""
    if len(times_ms) >= config.max_repeats:
        return False
    return len(times_ms) < config.min_repeats or sum(times_ms) / 1000.0 < config.target_s_per_point


def _point(batch: PackedBatch, times_ms: list[float], batch_flops) -> Point:
    p10, median, p90 = np.percentile(times_ms, [10, 50, 90])
    return Point(num_tokens=batch.num_queued_tokens, num_seqs=batch.num_seqs, max_seqlen=batch.max_seqlen,
                 median_ms=float(median), p10_ms=float(p10), p90_ms=float(p90), num_repeats=len(times_ms),
                 gflop_per_s=batch_flops(batch) / median / 1e6 if batch_flops else None)


def sweep(forward: Callable[[PackedBatch], object], make_batch: Callable[[int], PackedBatch],
          config: SweepConfig, timer=None, on_progress: Callable[[str, int, int], None] | None = None,
          batch_flops: Callable[[PackedBatch], float] | None = None,
          release: Callable[[], None] = release_memory) -> SweepResult:
    """Time ``forward`` on each grid size: one climb (warm-up, one timed run, find where to stop), then
    round-robin repeats so load lands on every size alike; ``release()`` after an out-of-memory error."""
    timer = timer or WallTimer()
    result = SweepResult()
    grid = token_grid(config.min_tokens, config.max_tokens, config.points_per_doubling)
    batches: list[PackedBatch] = []
    samples: list[list[float]] = []

    def out_of_memory(exc: Exception, num_tokens: int) -> bool:
        """Record an OOM (inside ``except``); anything else is raised."""
        if not is_out_of_memory(exc):
            raise exc
        result.out_of_memory_tokens = num_tokens
        result.stopped_reason = f"out of memory at {num_tokens} tokens ({type(exc).__name__})"
        return True

    for num_tokens in grid:
        batch = make_batch(num_tokens)
        if on_progress:
            on_progress(f"scanning {num_tokens} tokens", len(batches), 2 * len(grid))
        oom = False
        try:
            for _ in range(config.warmup_runs):
                forward(batch)
            first_ms = timer.time_ms(lambda: forward(batch))
        except Exception as exc:  # noqa: BLE001 - out_of_memory() re-raises anything else
            oom = out_of_memory(exc, num_tokens)
        if oom:  # out of the except block: the exception and its activations are gone
            release()
            break
        batches.append(batch)
        samples.append([first_ms])
        if first_ms > config.stop_ms:
            result.stopped_reason = (f"a {num_tokens}-token batch took {first_ms:.0f} ms, "
                                     f"over the {config.stop_ms:.0f} ms bound")
            break

    total = 2 * len(batches)
    while pending := [i for i, times_ms in enumerate(samples) if _needs_more(times_ms, config)]:
        if on_progress:
            done = total - len(pending)
            on_progress(f"timing {len(pending)} batch sizes, round {len(samples[pending[0]]) + 1}", done, total)
        for i in pending:
            oom = False
            try:
                samples[i].append(timer.time_ms(lambda: forward(batches[i])))
            except Exception as exc:  # noqa: BLE001 - as above; sizes from here up are dropped
                oom = out_of_memory(exc, batches[i].num_tokens)
            if oom:
                release()
                del batches[i:], samples[i:]
                total = 2 * len(batches)
                break
    result.points = [_point(b, t, batch_flops) for b, t in zip(batches, samples)]
    if on_progress:
        on_progress("done", total, total)
    return result
