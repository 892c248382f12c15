"""What a person watching a run sees: one progress bar per running stage in a terminal, plain
periodic lines otherwise.

Stage code reports into one process-wide board (``report``): a stage's work is split into parts
(shards, or the whole stage), each with done / total / failed counts in the stage's own unit
(samples, rows, tokens, optimizer steps). ``watch`` draws the board while a run goes on: with
rich's progress bars when the stream is a terminal (items done / total, rate, ETA, failures),
else a line per running stage every ``every_s`` seconds (the same numbers, plain text, fit for a
log file or CI). A stage whose work runs elsewhere (a Ray task, a torchrun process) reports what
reaches this process: shard completions, or the lines it streams back.

Nothing here imports Prefect; rich is imported only when a terminal is drawn.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class _Part:
    done: float = 0.0
    total: float = 0.0
    failed: int = 0


@dataclass
class StageProgress:
    """One stage's sum over its parts."""

    name: str
    unit: str
    started: float = field(default_factory=time.monotonic)
    parts: dict[str, _Part] = field(default_factory=dict)
    finished: bool = False

    @property
    def done(self) -> float:
        return sum(p.done for p in self.parts.values())

    @property
    def total(self) -> float:
        return sum(p.total for p in self.parts.values())

    @property
    def failed(self) -> int:
        return sum(p.failed for p in self.parts.values())

    def rate(self, now: float | None = None) -> float:
        elapsed = (now or time.monotonic()) - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta_s(self, now: float | None = None) -> float | None:
        rate = self.rate(now)
        return (self.total - self.done) / rate if rate > 0 and self.total >= self.done else None

    def line(self, now: float | None = None) -> str:
        """``extract: 1,200/4,000 tokens (30%), 52.1 tokens/s, ETA 54 s, failed 0``."""
        total, done = self.total, self.done
        share = f" ({100 * done / total:.0f}%)" if total else ""
        eta = self.eta_s(now)
        eta_text = "done" if self.finished else (f"ETA {_duration(eta)}" if eta is not None else "ETA -")
        return (
            f"{self.name}: {done:,.0f}/{total:,.0f} {self.unit}{share}, {self.rate(now):,.1f} {self.unit}/s, "
            f"{eta_text}, failed {self.failed}"
        )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Board:
    """Every stage's progress in this process; safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stages: dict[str, StageProgress] = {}

    def report(self, stage: str, part: str, done: float, total: float, failed: int = 0, unit: str = "items") -> None:
        with self._lock:
            entry = self._stages.get(stage)
            if entry is None or entry.finished:
                entry = self._stages[stage] = StageProgress(stage, unit)
            entry.parts[part] = _Part(done, total, failed)

    def finish(self, stage: str) -> None:
        with self._lock:
            if stage in self._stages:
                self._stages[stage].finished = True

    def snapshot(self) -> list[StageProgress]:
        """Copies, so a drawing thread never sees a half-made update."""
        with self._lock:
            return [
                StageProgress(
                    s.name,
                    s.unit,
                    s.started,
                    {k: _Part(p.done, p.total, p.failed) for k, p in s.parts.items()},
                    s.finished,
                )
                for s in self._stages.values()
            ]

    def clear(self) -> None:
        with self._lock:
            self._stages.clear()


BOARD = Board()


def report(stage: str, part: str, done: float, total: float, failed: int = 0, unit: str = "items") -> None:
    """Record ``part`` of ``stage`` (a shard, or "all") at ``done`` of ``total``; never raises."""
    try:
        BOARD.report(stage, part, done, total, failed, unit)
    except Exception:  # noqa: BLE001 -- a display must never stop the work it displays
        pass


def finish(stage: str) -> None:
    BOARD.finish(stage)


class _Lines:
    """A line per stage that moved (or every ``every_s`` seconds while it runs), and its last line once."""

    def __init__(self, stream: TextIO, every_s: float) -> None:
        self.stream, self.every_s = stream, every_s
        self._last: dict[str, float] = {}
        self._closed: set[str] = set()

    def draw(self, stages: list[StageProgress], final: bool = False) -> None:
        now = time.monotonic()
        for s in stages:
            if s.name in self._closed:
                continue
            due = now - self._last.get(s.name, 0.0) >= self.every_s
            if due or s.finished or final:
                print(s.line(now), file=self.stream, flush=True)
                self._last[s.name] = now
                if s.finished:
                    self._closed.add(s.name)

    def close(self) -> None:
        pass


class _Bars:
    """rich's progress bars, one per stage, redrawn in place."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            TextColumn("failed {task.fields[failed]}"),
            console=Console(file=stream, force_terminal=True),
            transient=False,
        )
        self.progress.start()
        self._ids: dict[str, int] = {}

    def draw(self, stages: list[StageProgress], final: bool = False) -> None:
        for s in stages:
            fields = {"unit": s.unit, "rate": f"{s.rate():,.1f} {s.unit}/s", "failed": s.failed}
            if s.name not in self._ids:
                self._ids[s.name] = self.progress.add_task(s.name, total=s.total or None, **fields)
            self.progress.update(self._ids[s.name], completed=s.done, total=s.total or None, **fields)
        self.progress.refresh()

    def close(self) -> None:
        self.progress.stop()


@contextlib.contextmanager
def watch(stream: TextIO | None = None, every_s: float = 10.0, refresh_s: float = 0.5, bars: bool | None = None):
    """Draw the board on ``stream`` (stderr by default) until the block ends: bars on a terminal,
    lines elsewhere (``bars`` forces either). The board starts empty."""
    stream = stream or sys.stderr
    use_bars = stream.isatty() if bars is None else bars
    BOARD.clear()
    view = _Bars(stream) if use_bars else _Lines(stream, every_s)
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(refresh_s):
            with contextlib.suppress(Exception):
                view.draw(BOARD.snapshot())

    thread = threading.Thread(target=loop, name="eagle3-progress", daemon=True)
    thread.start()
    try:
        yield BOARD
    finally:
        stop.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):
            view.draw(BOARD.snapshot(), final=True)
        view.close()
