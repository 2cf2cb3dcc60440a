"""A bulk job's progress: a rich bar on a terminal (rows, tokens/s, time left), else a plain line
every PLAIN_EVERY_S seconds."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

PLAIN_EVERY_S = 10.0
STEPS = 10_000  # the bar's resolution


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """``fraction()``: how much of the job is done (None while unknown); rows and tokens are
    this run's, counted by ``update``."""

    def __init__(self, fraction: Callable[[], float | None], *, committed_rows: int = 0,
                 stream=None, terminal: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self._fraction = fraction
        self._clock = clock
        self.start = clock()
        self.start_fraction: float | None = None
        self.rows = committed_rows
        self.tokens = 0
        self._last_line = self.start
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.terminal:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as Bar, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self._bar = Bar(TextColumn("embedding"), BarColumn(), TaskProgressColumn(),
                            TextColumn("{task.fields[rows]} rows"), TextColumn("{task.fields[speed]} tokens/s"),
                            TimeRemainingColumn(), console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("embedding", total=STEPS, rows=f"{self.rows:,}", speed="-")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self.update(0, self.tokens, force=True)
            self._bar.stop()

    def tokens_per_s(self) -> float:
        elapsed = self._clock() - self.start
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def update(self, rows: int, tokens: int, force: bool = False) -> None:
        """``rows`` more committed; ``tokens``: this run's tokens embedded so far."""
        self.rows += rows
        self.tokens = max(self.tokens, tokens)
        fraction = self._fraction()
        if fraction is not None and self.start_fraction is None:
            self.start_fraction = fraction
        if self._bar is not None:
            self._bar.update(self._task, completed=int((fraction or 0) * STEPS), rows=f"{self.rows:,}",
                             speed=f"{self.tokens_per_s():,.0f}")
            return
        now = self._clock()
        if not force and now - self._last_line < PLAIN_EVERY_S:
            return
        self._last_line = now
        print(self.line(fraction, now), file=self.stream, flush=True)

    def line(self, fraction: float | None, now: float) -> str:
        parts = [f"{self.rows:,} rows"]
        if fraction is not None:
            parts[0] += f" ({100 * fraction:.1f}%)"
        parts.append(f"{self.tokens_per_s():,.0f} tokens/s")
        done_now = (fraction or 0) - (self.start_fraction or 0)
        if fraction is not None and done_now > 0 and fraction < 1:
            left = (now - self.start) * (1 - fraction) / done_now
            parts.append(f"about {_duration(left)} left")
        return "embed-file: " + ", ".join(parts)

    def note(self, message: str) -> None:
        """A line beside the bar (a retry, a resume)."""
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, file=self.stream, flush=True)
