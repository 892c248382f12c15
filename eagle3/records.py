"""Append-only JSONL streams that survive a kill at any instant.

Design choices:
- Each record is one line, written with a single ``write`` and flushed at once, so a
  killed process loses at most the line being written. ``fsync`` runs every few records
  and on close: a power cut loses at most that many records, and they are regenerated.
- In the event loop the periodic fsync runs *behind* (``sync_behind``): in a worker thread,
  one at a time per file, nobody waiting for it (awaiting it cost the generation client
  ~0.09 ms of CPU per request, ~10%, against an instant server). When the disk is slower
  than ``fsync_every`` records arrive, the next fsync starts as soon as the running one
  ends. A failure there breaks the appender like a failed write: the next append or the
  close raises it, so no marker follows; ``close`` waits for a running fsync first.
- ``fsync_min_interval_s`` spaces a fast stream's fsyncs: an fsync that runs while records
  are still being appended to the file cost ~0.8 ms of kernel CPU each on this machine's
  ext4 (measured: every 16 records at ~1,300 records/s that was ~0.05 ms a record, a
  third of what the generation client adds to a plain script). A power cut then loses at
  most the larger of ``fsync_every`` records and that many seconds of them.
- A write that fails (disk full) cuts the file back to its last whole record and raises
  ``DiskWriteError``; the appender refuses further records, so no marker follows a lost write.
- A reader repairs a torn last line (a write cut short by a kill) by truncating the file
  to the last newline, with a warning naming how many bytes went. A bad line *inside*
  the file is not a torn write but damage: that is an error naming the file and line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

from eagle3.durable import DiskWriteError, writing
from eagle3.errors import InputError

log = logging.getLogger(__name__)

# One line per record, compact, UTF-8 as is: the bytes json.dumps(ensure_ascii=False, separators=(",", ":"))
# gives, ~13x faster (15 us of a generated record's ~1 ms of client CPU; benchmarks/bench_generation.py).
# Non-string keys become strings, as json writes them.
RECORD_OPTIONS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS


class RecordFileError(InputError, ValueError):
    """A JSONL file is damaged somewhere other than its last line."""


class JsonlAppender:
    """Appends one JSON object per line: flushed per record, fsynced every ``fsync_every`` records
    and, with ``fsync_min_interval_s``, at most once per that many seconds (a fast stream's fsyncs,
    run beside its appends, cost kernel CPU; the module docstring has the numbers).

    A write or fsync that fails (disk full, quota, I/O error) raises ``DiskWriteError`` naming the
    file and the free space, after cutting the file back to its last whole record: a disk that
    fills in the middle of a line leaves no torn record behind. The appender then refuses further
    records (what an fsync failure left on disk is unknown), so the caller stops the shard and no
    marker is written; the rerun resumes from the records that are whole."""

    def __init__(
        self, path: str | Path, fsync_every: int = 16, what: str = "append", fsync_min_interval_s: float = 0.0
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a symlink: the file appended to is the run dir's own
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordFileError(
                    f"{self.path}: is a symbolic link; records are appended only to a file of the run dir's own "
                    "(remove the link)"
                ) from None
            raise
        self._fsync_every = fsync_every
        self._min_interval = fsync_min_interval_s
        self._last_sync = time.monotonic()  # when the last fsync started
        self._unsynced = 0
        self._what = what
        self._broken = False
        self._error: OSError | None = None  # what an fsync behind raised: the next append or close raises it
        self._behind = None  # the fsync running behind (a future), if any
        self._lock = threading.Lock()  # held by an fsync behind; close takes it before closing the fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, record: dict, sync: bool = True) -> bool:
        """Write and flush one record. With ``sync=False`` the caller runs the due fsync itself
        (``sync_behind``) and this returns whether one is due."""
        self._write(orjson.dumps(record, option=RECORD_OPTIONS))
        self._unsynced += 1
        due = self._due()
        if due and sync:
            self.sync()
        return due

    def _due(self) -> bool:
        """``fsync_every`` records unsynced, and ``fsync_min_interval_s`` since the last fsync began."""
        return self._unsynced >= self._fsync_every and (
            not self._min_interval or time.monotonic() - self._last_sync >= self._min_interval
        )

    def _usable(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: appender is closed")
        if self._error is not None:
            raise self._error
        if self._broken:
            raise DiskWriteError(
                errno.EIO, f"{self._what}: {self.path}: an earlier write to this file failed; rerun to resume"
            )
        return self._fd

    def _write(self, data: bytes) -> None:
        fd = self._usable()
        with writing(self.path, self._what):
            written = 0
            try:
                view = memoryview(data)
                while view:  # a short write (disk filling up) is continued, and fails on the next call
                    n = os.write(fd, view)
                    view, written = view[n:], written + n
            except OSError:
                self._broken = True
                _cut_back(fd, written)
                raise

    @contextlib.contextmanager
    def _fsyncing(self) -> Iterator[int]:
        """The fd to fsync; a failure marks the appender broken and names the file (DiskWriteError)."""
        fd = self._usable()
        self._unsynced, self._last_sync = 0, time.monotonic()
        with writing(self.path, self._what):
            try:
                yield fd
            except OSError:
                self._broken = True
                raise

    def sync(self) -> None:
        if self._unsynced:
            with self._fsyncing() as fd:
                os.fsync(fd)

    def sync_behind(self) -> None:
        """Start the due fsync in a worker thread and return at once (event loop only); see the module
        docstring. A failure is raised by the next append or by close."""
        import asyncio

        if self._behind is not None or not self._unsynced or self._fd is None:
            return
        fd = self._usable()
        self._unsynced, self._last_sync = 0, time.monotonic()
        self._behind = asyncio.get_running_loop().run_in_executor(None, self._fsync_behind, fd)
        self._behind.add_done_callback(self._behind_done)

    def _fsync_behind(self, fd: int) -> None:
        with self._lock:
            if self._fd != fd:  # closed meanwhile (close synced it)
                return
            try:
                with writing(self.path, self._what):
                    os.fsync(fd)
            except OSError as exc:  # set here, not in the callback: close may run before the callback does
                self._broken, self._error = True, exc

    def _behind_done(self, _future) -> None:
        self._behind = None
        if self._due() and self._fd is not None and not self._broken:
            self.sync_behind()  # records fell due while it ran

    def close(self) -> None:
        """fsync what is unsynced and close; after a failed write, just close (the error was raised).
        An fsync behind that failed is raised here, after closing."""
        if self._fd is None:
            return
        with self._lock:  # a running fsync behind ends first
            try:
                if not self._broken:
                    self.sync()
            finally:
                os.close(self._fd)
                self._fd = None
        if self._error is not None:
            raise self._error

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cut_back(fd: int, written: int) -> None:
    """Drop the ``written`` bytes of a record whose write failed (truncating needs no free space): it
    began that far before the file's end, so no fstat per record is needed on the hot path. A records
    file has one writer (a shard's lock guards its streams), so nothing else appends in between."""
    try:
        os.ftruncate(fd, os.fstat(fd).st_size - written)
    except OSError:
        log.warning("could not cut a partial record off fd %d; the next reader repairs the torn tail", fd)


def repair_torn_tail(path: Path, logger: logging.Logger | logging.LoggerAdapter | None = None) -> int:
    """Cut an unterminated last line off ``path``; returns the number of bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return 0
        block = min(size, 1 << 20)
        while True:
            fh.seek(size - block)
            cut = fh.read(block).rfind(b"\n")
            if cut >= 0 or block == size:
                break
            block = min(size, block * 4)
        keep = size - block + cut + 1 if cut >= 0 else 0
        fh.truncate(keep)
        os.fsync(fh.fileno())
    (logger or log).warning("%s: removed a torn last line (%d bytes) left by an interrupted write", path, size - keep)
    return size - keep


def iter_records(path: str | Path, logger=None) -> Iterator[dict]:
    """Records of a JSONL stream one at a time, after repairing a torn tail. Missing file: none."""
    path = Path(path)
    if not path.exists():
        return
    repair_torn_tail(path, logger)
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RecordFileError(
                    f"{path}:{lineno}: damaged record ({exc}); move the file aside to regenerate its shard"
                ) from None


def read_records(path: str | Path, logger=None) -> list[dict]:
    """All records of a JSONL stream (see ``iter_records``)."""
    return list(iter_records(path, logger))


def read_ids(path: str | Path, logger=None) -> set[str]:
    """The ids of a stream's records, without keeping the records (memory stays flat)."""
    return {record["id"] for record in iter_records(path, logger)}
