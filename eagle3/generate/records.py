"""Append-only JSONL streams that survive a kill at any instant.

Design choices:
- Each record is one line, written with a single ``write`` and flushed at once, so a
  killed process loses at most the line being written. ``fsync`` runs every few records
  and on close: a power cut loses at most that many records, and they are regenerated.
- A reader repairs a torn last line (a write cut short by a kill) by truncating the file
  to the last newline, with a warning naming how many bytes went. A bad line *inside*
  the file is not a torn write but damage: that is an error naming the file and line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


class RecordFileError(ValueError):
    """A JSONL file is damaged somewhere other than its last line."""


class JsonlAppender:
    """Appends one JSON object per line: flushed per record, fsynced every ``fsync_every``."""

    def __init__(self, path: str | Path, fsync_every: int = 16):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab", buffering=0)
        self._fsync_every = fsync_every
        self._unsynced = 0

    def append(self, record: dict, sync: bool = True) -> bool:
        """Write and flush one record. With ``sync=False`` the caller runs the due fsync itself
        (``sync_soon``) and this returns whether one is due."""
        self._fh.write((json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
        self._unsynced += 1
        due = self._unsynced >= self._fsync_every
        if due and sync:
            self.sync()
        return due

    def sync(self) -> None:
        if self._unsynced:
            self._unsynced = 0
            os.fsync(self._fh.fileno())

    async def sync_soon(self) -> None:
        """fsync in a worker thread: an event loop blocked in fsync stalls every request in flight."""
        import asyncio

        if self._unsynced and not self._fh.closed:
            self._unsynced = 0
            await asyncio.to_thread(os.fsync, self._fh.fileno())

    def close(self) -> None:
        if not self._fh.closed:
            self.sync()
            self._fh.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
                raise RecordFileError(f"{path}:{lineno}: damaged record ({exc}); move the file aside to regenerate its shard") from None


def read_records(path: str | Path, logger=None) -> list[dict]:
    """All records of a JSONL stream (see ``iter_records``)."""
    return list(iter_records(path, logger))


def read_ids(path: str | Path, logger=None) -> set[str]:
    """The ids of a stream's records, without keeping the records (memory stays flat)."""
    return {record["id"] for record in iter_records(path, logger)}
