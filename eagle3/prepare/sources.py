"""Prompt sources: the shipped demo file, local files or folders, and hub datasets.

Design choices:
- JSON Lines and JSON files are parsed here, line by line, rather than through
  ``datasets``' JSON builder: that builder infers one Arrow schema for the whole file and
  fails (or silently coerces) on a row whose types differ from the rest, which is exactly
  the bad row we must reject on its own, naming its line. Parquet files and hub datasets
  are typed already and go through ``datasets.load_dataset``.
- Every row gets a ``source_index`` (its position over the whole source, files taken in
  sorted order) and an ``origin`` a person can open (``file.jsonl:17``).
- A fingerprint (paths, sizes, modification times; for the hub, the dataset's own
  fingerprint) lets a rerun on unchanged input skip the stage without reading it.
- Streaming (``data.streaming``): a local Parquet file is read one record batch at a time
  with pyarrow (never whole, never copied into the datasets cache); a hub dataset comes from
  ``load_dataset(streaming=True)``. A local source's rows are counted before sampling, so
  ``limit`` picks the same rows streamed or not. A streamed hub dataset has no length; its
  ``limit`` sample is a seeded reservoir sample over one pass (Algorithm R): uniform, holding
  ``limit`` rows, then put back in source order.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from eagle3.errors import InputError
from eagle3.prepare.normalize import Rejected

BUILTIN = {"builtin:demo_prompts": "demo_prompts.jsonl"}
SUFFIXES = (".jsonl", ".json", ".parquet")


class SourceError(InputError, ValueError):
    """The source as a whole cannot be read (missing file, unsupported format, hub failure)."""


@dataclass(frozen=True)
class SourceRow:
    index: int
    origin: str
    value: Any  # the decoded row, or a Rejected when the line itself is unreadable


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("eagle3") / "data" / BUILTIN[name]))


def local_files(spec: str) -> list[Path] | None:
    """The files a local source names, or None when ``spec`` is not a local path."""
    if spec in BUILTIN:
        return [builtin_path(spec)]
    path = Path(spec).expanduser()
    if path.is_file():
        if not path.name.endswith(SUFFIXES):
            raise SourceError(f"data.source {spec!r}: unsupported file type; use one of {', '.join(SUFFIXES)}")
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        if not files:
            raise SourceError(f"data.source {spec!r}: folder has no {', '.join(SUFFIXES)} files")
        return files
    if spec.startswith((".", "/", "~")) or spec.endswith(SUFFIXES) or spec.count("/") > 1:
        raise SourceError(f"data.source {spec!r}: no such file or folder (and not a hub id of the form owner/name)")
    return None


def _json_lines(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            origin = f"{name}:{lineno}"
            try:
                yield origin, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield origin, Rejected("invalid_utf8", f"line {lineno} is not UTF-8 ({exc.reason})")
            except json.JSONDecodeError as exc:
                yield (
                    origin,
                    Rejected("invalid_json", f"line {lineno} is not valid JSON ({exc.msg} at column {exc.colno})"),
                )


def _json_array(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"{path}: not valid JSON ({exc}); for one object per line use a .jsonl file") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise SourceError(f"{path}: expected a JSON list of rows (or an object holding exactly one list)")
        data = lists[0]
    if not isinstance(data, list):
        raise SourceError(f"{path}: expected a JSON list of rows, found {type(data).__name__}")
    for k, row in enumerate(data):
        yield f"{name}[{k}]", row


PARQUET_BATCH = 1024  # rows per record batch when streaming a local Parquet file


def _parquet_stream(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:
        raise SourceError(f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})") from None
    k = 0
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH):
        for row in batch.to_pylist():
            yield f"{name}#row{k}", row
            k += 1


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:
        raise SourceError(f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})") from None


def _parquet(path: Path, name: str) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types; the message is what matters
        raise SourceError(f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})") from None
    for k, row in enumerate(ds):
        yield f"{name}#row{k}", row


def _file_rows(path: Path, name: str, streaming: bool) -> Iterator[tuple[str, Any]]:
    if path.name.endswith(".jsonl"):
        return _json_lines(path, name)
    if path.name.endswith(".json"):
        return _json_array(path, name)
    return _parquet_stream(path, name) if streaming else _parquet(path, name)


def _hub_dataset(spec: str, split: str, subset: str | None, streaming: bool):
    import datasets

    # Only the arguments a user set are passed, so a plain hub source is loaded exactly as before.
    extra: dict[str, Any] = {}
    if subset is not None:
        extra["name"] = subset
    if streaming:
        extra["streaming"] = True
    try:
        return datasets.load_dataset(spec, split=split, **extra)
    except Exception as exc:
        what = f"split {split!r}" + (f", subset {subset!r}" if subset is not None else "")
        raise SourceError(
            f"source {spec!r} ({what}): could not load from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            "Without network access, point data.source (with a preset: data.preset_source; in data.mix: the "
            "entry's source) at a local file."
        ) from None


def reservoir(items: Iterator[Any], size: int, seed: int) -> list[tuple[int, Any]]:
    """A uniform seeded sample of ``size`` items from a stream of unknown length, as (position, item)
    pairs in stream order (Algorithm R: item k replaces a random slot with probability size / (k + 1))."""
    rng = random.Random(seed)
    kept: list[tuple[int, Any]] = []
    for k, item in enumerate(items):
        if k < size:
            kept.append((k, item))
        else:
            slot = rng.randrange(k + 1)
            if slot < size:
                kept[slot] = (k, item)
    return sorted(kept, key=lambda pair: pair[0])


class Source:
    """One prompt source, iterated as ``SourceRow``s with an optional seeded row sample."""

    def __init__(self, spec: str, split: str = "train", subset: str | None = None, streaming: bool = False):
        self.spec = spec
        self.split = split
        self.subset = subset
        self.streaming = streaming
        self.files = local_files(spec)
        self._hub = None if self.files is not None else _hub_dataset(spec, split, subset, streaming)
        self._count: int | None = None

    def fingerprint(self) -> str:
        if self.files is None:
            parts: list = [self.spec, self.split, getattr(self._hub, "_fingerprint", None)]
            if self.subset is not None:
                parts.append(self.subset)
        else:
            parts = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.files]
        return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]

    @property
    def sized(self) -> bool:
        """Whether the row count is known without reading the rows from the hub (not a streamed hub set)."""
        return self.files is not None or not self.streaming

    def _all(self) -> Iterator[tuple[str, Any]]:
        if self.files is None:
            for k, row in enumerate(self._hub):
                yield f"{self.spec}[{self.split}]#{k}", row
            return
        for path in self.files:
            # Origins name what the user wrote (builtin:..., a relative path), not where it is installed.
            yield from _file_rows(path, self.spec if self.spec in BUILTIN else str(path), self.streaming)

    def _count_rows(self) -> int:
        if self.files is None:
            return len(self._hub)
        if self.streaming:
            return sum(
                _parquet_rows(p) if p.name.endswith(".parquet") else sum(1 for _ in _file_rows(p, "", True))
                for p in self.files
            )
        return sum(1 for _ in self._all())

    def count(self) -> int:
        if not self.sized:
            raise SourceError(f"data.source {self.spec!r} is a streamed hub dataset: its row count is unknown")
        if self._count is None:
            self._count = self._count_rows()
        return self._count

    def rows(self, limit: int | None = None, seed: int = 0) -> Iterator[SourceRow]:
        """Rows in source order; with ``limit``, a seeded sample of that many rows, still in order."""
        if limit is not None and not self.sized:
            for index, (origin, value) in reservoir(self._all(), limit, seed):
                yield SourceRow(index, origin, value)
            return
        keep = None
        if limit is not None:
            total = self.count()
            if total > limit:
                keep = set(random.Random(seed).sample(range(total), limit))
        for index, (origin, value) in enumerate(self._all()):
            if keep is None or index in keep:
                yield SourceRow(index, origin, value)
