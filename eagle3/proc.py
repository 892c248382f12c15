"""Child process groups: start one under a guard, pump its output, hold it to a deadline, stop it.

The managed vLLM server, the vLLM extraction worker and torchrun all run through ``Child``:
- its own session and process group, so a terminal's Ctrl-C does not reach it half-way and one
  ``killpg`` reaches its children; a guard process and a pidfile (orphans.py) stop the
  group when this process dies without cleaning up, even by SIGKILL;
- stdout and stderr share one pipe, drained by a thread: an undrained pipe blocks the child on its
  next line, so neither a slow logger nor a failing log file may stop the pump;
- stopping is SIGTERM to the group, a grace period, then SIGKILL to the group and every descendant.
Why each choice: docs/design.md, "Child processes".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from eagle3 import orphans
from eagle3.errors import TransientError

# Reading the output after the group is gone: EOF comes once every writer of the pipe is gone.
READER_JOIN_S = 5.0
# A finished child's leftovers (an engine-core child, say) get this long to leave after SIGTERM.
LEFTOVER_GRACE_S = 2.0


class DeadlineExceeded(TransientError, RuntimeError):
    """A child ran past its deadline and was stopped; ``tail`` holds its last output lines."""

    def __init__(self, message: str, timeout_s: float, tail: list[str]) -> None:
        super().__init__(message)
        self.timeout_s, self.tail = timeout_s, tail


class _Pump(threading.Thread):
    """Reads the child's output: scrubs it, writes the log file, logs each line, keeps a tail."""

    def __init__(self, stream, log_file, child: Child) -> None:
        super().__init__(name=f"output {child.name}", daemon=True)
        self._stream, self._file, self._child = stream, log_file, child
        self._tail: collections.deque[str] = collections.deque(maxlen=child.tail_lines)
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                self._emit(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        finally:
            if self._file is not None:
                with contextlib.suppress(OSError):  # a full disk fails the final flush too
                    self._file.close()

    def _emit(self, line: str) -> None:
        child = self._child
        if child.scrub:
            line = line.replace(child.scrub, "***")
        self._write(line)
        with self._lock:
            self._tail.append(line)
        level = child.level_of(line) if child.level_of else logging.INFO
        if child.prefix:
            child.logger.log(level, "%s %s", child.prefix, line)
        else:
            child.logger.log(level, "%s", line)
        if child.on_line is not None:
            try:
                child.on_line(line)
            except Exception as exc:  # noqa: BLE001 - a display hook must never stop the pump
                child.logger.warning("%s: output handler failed: %s", child.name, exc)

    def _write(self, line: str) -> None:
        if self._file is None or self._file.closed:
            return
        try:
            self._file.write(line + "\n")
        except OSError as exc:
            child = self._child
            child.logger.error("%s log file %s unwritable, logging only: %s", child.name, child.log_path, exc)
            with contextlib.suppress(OSError):
                self._file.close()

    def tail(self) -> list[str]:
        with self._lock:
            return list(self._tail)


class Child:
    """One child process group. ``Child(argv, name=..., logger=...).start()``, then ``wait`` or ``stop``.

    name: how messages call it ("vLLM server", "torchrun"). env: the child's whole environment
    (None: this process's). pidfile: where the group is recorded for the next start to reap, if
    this process and the guard both die. grace_s: SIGTERM to SIGKILL. log_path: the output is
    appended there, after a header line; guard_note: where the guard notes acting (default: the
    pidfile's ``.guard.log``). prefix: put before each logged line. scrub: a secret replaced by
    ``***`` before the line goes anywhere. level_of(line): the logging level of a line (INFO).
    on_line(line): sees every line, after it was logged. tail_lines: how many lines errors quote.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        logger: logging.Logger | logging.LoggerAdapter,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        pidfile: str | Path | None = None,
        grace_s: float = 10.0,
        log_path: str | Path | None = None,
        guard_note: str | Path | None = None,
        prefix: str | None = None,
        scrub: str | None = None,
        level_of: Callable[[str], int] | None = None,
        on_line: Callable[[str], None] | None = None,
        tail_lines: int = 40,
    ) -> None:
        self.argv, self.name, self.logger = list(argv), name, logger
        self.env = dict(env) if env is not None else None
        self.cwd, self.grace_s = cwd, grace_s
        self.pidfile = Path(pidfile) if pidfile is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.guard_note = guard_note
        self.prefix, self.scrub, self.level_of, self.on_line = prefix, scrub, level_of, on_line
        self.tail_lines = tail_lines
        self.proc: subprocess.Popen | None = None
        self._pump: _Pump | None = None

    @property
    def pid(self) -> int | None:
        """The leader's pid, which is also the group id."""
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self) -> list[str]:
        return self._pump.tail() if self._pump else []

    def join_output(self, timeout_s: float) -> None:
        """Give the pump ``timeout_s`` to read what a dying child still wrote."""
        if self._pump is not None:
            self._pump.join(timeout_s)

    def start(self) -> Child:
        """Reap a group a killed earlier run left behind (pidfile), spawn, guard, pump. OSError if
        the program cannot start."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: a Child starts once")
        if self.pidfile is not None:
            orphans.reap_stale(self.pidfile, self.grace_s, self.logger)
        log_file = self._open_log()
        with orphans.starting():  # spawned and guarded as one step: a stop signal waits for its end
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError:
                if log_file is not None:
                    log_file.close()
                raise
            orphans.guard_group(self.proc.pid, pidfile=self.pidfile, grace_s=self.grace_s, note=self.guard_note)
        self._pump = _Pump(self.proc.stdout, log_file, self)
        self._pump.start()
        return self

    def _open_log(self):
        if self.log_path is None:
            return None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: each line reaches the OS at once, so the log is current while the child runs.
        log_file = open(self.log_path, "a", buffering=1, encoding="utf-8")
        log_file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n")
        return log_file

    def wait(self, timeout_s: float) -> int:
        """The exit code, once the child exits within ``timeout_s``. Past it, the group is stopped and
        DeadlineExceeded names the deadline and the log; any other interruption (Ctrl-C) stops it too."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise self._deadline_error(timeout_s) from None
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float | None = None) -> list[int]:
        """SIGTERM the group, ``grace_s`` (default: the Child's), SIGKILL the group and its descendants;
        drain the output. Returns the pids that survived SIGKILL (then the guard stays armed)."""
        if self.proc is None:
            return []
        pgid, grace = self.proc.pid, self.grace_s if grace_s is None else grace_s

        def escalate(_left: list[int]) -> None:
            self.logger.warning("%s group %d still alive %.0f s after SIGTERM: sending SIGKILL", self.name, pgid, grace)

        leftover = orphans.terminate_group(pgid, grace, on_kill=escalate)
        if pgid in leftover:
            self.proc.poll()  # a leader stuck past SIGKILL must not hang us in wait()
        else:
            self.proc.wait()
        self.join_output(READER_JOIN_S)
        if not leftover:
            orphans.release(pgid)
        return leftover

    def _deadline_error(self, timeout_s: float) -> DeadlineExceeded:
        where = str(self.log_path) if self.log_path else f"logger {getattr(self.logger, 'name', '?')!r}"
        tail = self.tail()
        return DeadlineExceeded(
            f"{self.name} ran past its deadline of {timeout_s:g} s and was stopped; log {where}, last lines:\n"
            + "\n".join(tail),
            timeout_s,
            tail,
        )


def run(argv: Sequence[str], *, timeout_s: float, **child_args) -> Child:
    """Run a child to its end under ``timeout_s`` (see Child.wait), then stop what it left behind in
    its group. Returns the finished Child (``returncode``, ``tail()``); the caller judges the code."""
    child = Child(argv, **child_args).start()
    child.wait(timeout_s)
    child.stop(LEFTOVER_GRACE_S)
    return child
