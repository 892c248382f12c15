"""Stage ``prepare``: source rows -> de-duplicated prompts in deterministic Parquet shards.

Design choices:
- Accounting unit: a *candidate prompt*. A row that cannot be read is one candidate
  (rejected); a readable row yields one candidate per prompt it produces (several in
  ``all_turns`` mode). ``in == ok + filtered`` always; ``failed`` is 0 here because
  nothing in this stage is transient. The source row count is recorded beside it.
- Shard of a prompt = hash(seed, id) mod num_shards: deterministic, balanced in
  expectation, and stable when prompts are added to the source (a nightly run with new
  prompts does not move old ones to other shards). Inside a shard rows keep source order.
- The same input gives byte-identical shards. A rerun whose input fingerprint and
  settings match the completion marker does nothing; otherwise shards are rebuilt in a
  temporary file and only replace the old file when their bytes differ, so a deleted
  shard is rebuilt and its siblings stay untouched.
- The completion marker ``prompts/done.json`` (eagle3/markers.py) is removed first and written
  last: a killed run never leaves a marker over partial output.
- Memory stays bounded: rows stream into per-shard Parquet writers; only the set of
  seen ids is kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import DataConfig, PipelineConfig, section_hash
from eagle3.durable import atomic_path, install_file, remove_inside, sha256_file
from eagle3.errors import InputError
from eagle3.layout import STAGE_MARKER, RunLayout
from eagle3.manifest import StageCounts, record_stage, versions
from eagle3.markers import Marker, read_marker, remove_marker, write_marker
from eagle3.prepare.normalize import Prompt, Rejected, candidates
from eagle3.prepare.sources import Source

STAGE = "prepare"
MARKER = STAGE_MARKER  # prompts/done.json
ROW_GROUP = 1000

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("source_index", pa.int64()),
    ]
)


class PrepareError(InputError, RuntimeError):
    """The stage ran but its result must not be used (too many rejected rows)."""


@dataclass(frozen=True)
class PrepareResult:
    """What crosses the task boundary: paths and counts, never rows."""

    out_dir: str
    shards: tuple[str, ...]
    counts: dict
    fingerprint: str
    skipped: bool


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.parquet"


def shard_of(prompt_id: str, seed: int, num_shards: int) -> int:
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


class _ShardWriter:
    """Streams one shard into a temporary Parquet file in fixed-size row groups."""

    def __init__(self, tmp: Path):
        self.writer = pq.ParquetWriter(tmp, SCHEMA, compression="zstd")
        self.buffer: list[tuple[Prompt, int]] = []
        self.rows = 0

    def add(self, prompt: Prompt, source_index: int) -> None:
        self.buffer.append((prompt, source_index))
        self.rows += 1
        if len(self.buffer) >= ROW_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            table = pa.Table.from_pydict(
                {
                    "id": [p.id for p, _ in self.buffer],
                    "messages": [p.as_messages() for p, _ in self.buffer],
                    "source_index": [i for _, i in self.buffer],
                },
                schema=SCHEMA,
            )
            self.writer.write_table(table)
            self.buffer = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


@dataclass
class _Tally:
    in_: int = 0
    ok: int = 0
    source_rows: int = 0
    reasons: Counter = field(default_factory=Counter)
    invalid: int = 0


def _fingerprint(data: DataConfig, source: Source) -> str:
    return hashlib.sha256(f"{section_hash(data)}:{source.fingerprint()}".encode()).hexdigest()[:16]


def _up_to_date(layout: RunLayout, fingerprint: str) -> Marker | None:
    done = read_marker(layout.prompts_marker, STAGE)
    if done is None or done.key != fingerprint:
        return None
    for shard in done["shards"]:
        path = layout.prompts / shard["name"]
        if not path.exists() or sha256_file(path) != shard["sha256"]:
            return None
    return done


def _entry(done: Marker) -> dict:
    """The manifest entry the marker was written with (an earlier release kept it as its counts)."""
    return done.get("manifest_entry") or done.counts


def _reject(tally: _Tally, rejected_fh, row_index: int, origin: str, rej: Rejected) -> None:
    tally.reasons[rej.kind] += 1
    if rej.kind != "duplicate":
        tally.invalid += 1
    record = {"source_index": row_index, "origin": origin, "kind": rej.kind, "reason": str(rej)}
    rejected_fh.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def _stream(data: DataConfig, source: Source, writers: list[_ShardWriter], rejected_fh) -> _Tally:
    tally = _Tally()
    seen: dict[str, int] = {}
    for row in source.rows(data.limit, data.seed):
        tally.source_rows += 1
        results = (
            [row.value] if isinstance(row.value, Rejected) else candidates(row.value, data.turns, data.max_prompt_chars)
        )
        for item in results:
            tally.in_ += 1
            if isinstance(item, Rejected):
                _reject(tally, rejected_fh, row.index, row.origin, item)
            elif item.id in seen:
                dup = Rejected("duplicate", f"same prompt as id {item.id} (source_index {seen[item.id]})")
                _reject(tally, rejected_fh, row.index, row.origin, dup)
            else:
                seen[item.id] = row.index
                writers[shard_of(item.id, data.seed, data.num_shards)].add(item, row.index)
                tally.ok += 1
    return tally


def _write_shards(
    data: DataConfig, source: Source, layout: RunLayout, log: logging.Logger
) -> tuple[_Tally, list[dict]]:
    out = layout.prompts
    tmps = [out / f".{shard_name(k)}.partial" for k in range(data.num_shards)]
    writers = [_ShardWriter(t) for t in tmps]
    try:
        with atomic_path(layout.prompts_rejected) as rej_tmp, open(rej_tmp, "w", encoding="utf-8") as rejected_fh:
            tally = _stream(data, source, writers, rejected_fh)
            for w in writers:
                w.close()
            rejected_fh.flush()
    finally:
        for w in writers:
            if w.writer.is_open:
                w.writer.close()
    shards = []
    for k, (tmp, w) in enumerate(zip(tmps, writers)):
        target = layout.prompt_shard(shard_name(k))
        if install_file(tmp, target):
            log.info("prepare: wrote %s (%d prompts)", target.name, w.rows)
        shards.append({"name": target.name, "rows": w.rows, "sha256": sha256_file(target)})
    return tally, shards


def _remove_stale(layout: RunLayout, keep: set[str], log: logging.Logger) -> None:
    for path in layout.prompts.glob("shard-*.parquet"):
        if path.name not in keep:
            log.warning("prepare: removing %s left from an earlier run with more shards", path.name)
            remove_inside(path, layout.root, missing_ok=False)


def _rejection_error(data: DataConfig, tally: _Tally, layout: RunLayout) -> str | None:
    if tally.in_ == 0:
        return f"prepare: data.source {data.source!r} holds no rows"
    if tally.invalid / tally.in_ > data.max_rejected_fraction:
        top = ", ".join(f"{k}={n}" for k, n in tally.reasons.most_common(3))
        return (
            f"prepare: {tally.invalid} of {tally.in_} candidate prompts were rejected as invalid "
            f"({tally.invalid / tally.in_:.0%} > data.max_rejected_fraction={data.max_rejected_fraction}); "
            f"top reasons: {top}; every rejected row is listed in {layout.prompts_rejected}"
        )
    return None


def _source(config: PipelineConfig) -> Source:
    """The configured source; for self:prompts, the prompts the target wrote (the prepare flow writes them first)."""
    from eagle3.prepare import self_prompts

    data = config.data
    if not self_prompts.is_self_source(data.source):
        return Source(data.source, data.split)
    layout = RunLayout.of(config)
    if read_marker(layout.self_prompts_marker, self_prompts.STAGE) is None:
        raise PrepareError(
            f"prepare: data.source={data.source!r} needs the prompts the target writes, and "
            f"{layout.self_prompts_marker} does not exist; run the prepare flow (eagle3 prepare / eagle3 run), "
            "which serves the target and writes them first"
        )
    return Source(str(layout.self_prompts_file), data.split)


def run_prepare(config: PipelineConfig, logger: logging.Logger | None = None) -> PrepareResult:
    """Run the stage into ``RUN/prompts``; skip when the completion marker is current."""
    log = logger or logging.getLogger(__name__)
    data = config.data
    layout = RunLayout.of(config)
    out = layout.prompts
    out.mkdir(parents=True, exist_ok=True)
    source = _source(config)
    fingerprint = _fingerprint(data, source)
    done = _up_to_date(layout, fingerprint)
    if done is not None:
        log.info("prepare: up to date (%s), nothing to do", done.path)
        return PrepareResult(str(out), tuple(s["name"] for s in done["shards"]), _entry(done), fingerprint, True)
    remove_marker(layout.prompts_marker, config.run_dir)
    for leftover in [*out.glob(".*.partial"), *out.glob(".*.tmp")]:
        remove_inside(leftover, config.run_dir, missing_ok=False)  # temporary files of a run that was killed
    tally, shards = _write_shards(data, source, layout, log)
    _remove_stale(layout, {s["name"] for s in shards}, log)
    counts = StageCounts(tally.in_, tally.ok, 0, tally.in_ - tally.ok, dict(tally.reasons))
    error = _rejection_error(data, tally, layout)
    entry = record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="failed" if error else "ok",
        error=error,
        config_hash=section_hash(data),
        fingerprint=fingerprint,
        source=data.source,
        source_rows=tally.source_rows,
        shards=[s["rows"] for s in shards],
        versions=versions("pyarrow", "datasets"),
    )
    if error:
        raise PrepareError(error)
    write_marker(
        layout.prompts_marker,
        STAGE,
        fingerprint,
        {**counts.as_dict(), "source_rows": tally.source_rows},
        shards=shards,
        manifest_entry=entry,
    )
    log.info(
        "prepare: %d rows -> %d prompts in %d shards, %d filtered (%s)",
        tally.source_rows,
        tally.ok,
        len(shards),
        counts.filtered,
        dict(tally.reasons),
    )
    return PrepareResult(str(out), tuple(s["name"] for s in shards), entry, fingerprint, False)


def summary_line(result, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    run = Path(run_dir)
    return f"prompts:      {run / 'prompts'}  (rejected rows and reasons: {run / 'prompts' / 'rejected.jsonl'})"
