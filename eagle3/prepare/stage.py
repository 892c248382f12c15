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
- Several sources (``data.mix``, eagle3/prepare/mix.py) are read one after the other, each
  counted on its own (``sources`` in the manifest entry: in == ok + filtered per source, and
  the stage's counts are their sums). Only a mixed run's shards carry a ``source`` column and
  its rejected.jsonl lines a ``source`` key: an unmixed run's files keep their bytes.
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

from eagle3.config import DataConfig, PipelineConfig
from eagle3.durable import atomic_path, install_file, remove_inside, sha256_file
from eagle3.errors import InputError
from eagle3.layout import STAGE_MARKER, RunLayout
from eagle3.manifest import record_stage, versions
from eagle3.markers import Marker, read_marker, remove_marker, write_marker
from eagle3.prepare.mix import Part, plan
from eagle3.prepare.normalize import Prompt, Rejected, candidates
from eagle3.results import StageCounts

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
SCHEMA_MIXED = SCHEMA.append(pa.field("source", pa.string()))  # a mixed run: which data.mix entry


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

    def __init__(self, tmp: Path, mixed: bool = False):
        self.schema = SCHEMA_MIXED if mixed else SCHEMA
        self.writer = pq.ParquetWriter(tmp, self.schema, compression="zstd")
        self.buffer: list[tuple[Prompt, int, str]] = []
        self.rows = 0

    def add(self, prompt: Prompt, source_index: int, source: str) -> None:
        self.buffer.append((prompt, source_index, source))
        self.rows += 1
        if len(self.buffer) >= ROW_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            columns = {
                "id": [p.id for p, _, _ in self.buffer],
                "messages": [p.as_messages() for p, _, _ in self.buffer],
                "source_index": [i for _, i, _ in self.buffer],
            }
            if self.schema is SCHEMA_MIXED:
                columns["source"] = [s for _, _, s in self.buffer]
            table = pa.Table.from_pydict(columns, schema=self.schema)
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

    def add(self, other: _Tally) -> None:
        self.in_ += other.in_
        self.ok += other.ok
        self.source_rows += other.source_rows
        self.reasons.update(other.reasons)
        self.invalid += other.invalid

    def counts(self) -> StageCounts:
        return StageCounts(self.in_, self.ok, 0, self.in_ - self.ok, dict(self.reasons))


def _fingerprint(data: DataConfig, parts: list[Part]) -> str:
    """The settings' hash and every source's fingerprint (for one plain source, the same value as
    releases before presets and mixes computed, so their markers stay current)."""
    sources = ":".join(p.source.fingerprint() for p in parts)
    return hashlib.sha256(f"{data.config_hash()}:{sources}".encode()).hexdigest()[:16]


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


def _reject(tally: _Tally, rejected_fh, row_index: int, origin: str, rej: Rejected, source: str | None) -> None:
    tally.reasons[rej.kind] += 1
    if rej.kind != "duplicate":
        tally.invalid += 1
    record = {"source_index": row_index, "origin": origin, "kind": rej.kind, "reason": str(rej)}
    if source is not None:
        record["source"] = source
    rejected_fh.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")


def _candidates(part: Part, value, data: DataConfig) -> list:
    if isinstance(value, Rejected):
        return [value]
    if part.preset is not None:
        value = part.preset.to_messages(value)
        if isinstance(value, Rejected):
            return [value]
    return candidates(value, data.turns, data.max_prompt_chars)


def _stream(data: DataConfig, parts: list[Part], writers: list[_ShardWriter], rejected_fh) -> list[_Tally]:
    """One tally per part; ``seen`` spans all parts, so a prompt of an earlier part is a later one's duplicate."""
    seen: dict[str, tuple[str, int]] = {}
    mixed = bool(data.mix)
    tallies = []
    for part in parts:
        tally = _Tally()
        label = part.name if mixed else None
        for row in part.source.rows(part.quota, part.seed):
            tally.source_rows += 1
            for item in _candidates(part, row.value, data):
                tally.in_ += 1
                if isinstance(item, Rejected):
                    _reject(tally, rejected_fh, row.index, row.origin, item, label)
                elif item.id in seen:
                    where, index = seen[item.id]
                    at = f"source {where}, source_index {index}" if mixed else f"source_index {index}"
                    dup = Rejected("duplicate", f"same prompt as id {item.id} ({at})")
                    _reject(tally, rejected_fh, row.index, row.origin, dup, label)
                else:
                    seen[item.id] = (part.name, row.index)
                    writers[shard_of(item.id, data.seed, data.num_shards)].add(item, row.index, part.name)
                    tally.ok += 1
        tallies.append(tally)
    return tallies


def _per_source(parts: list[Part], tallies: list[_Tally]) -> list[dict]:
    """Each part's settings and counts; each must add up on its own (in == ok + failed + filtered)."""
    out = []
    for part, tally in zip(parts, tallies):
        counts = tally.counts()
        counts.check(f"{STAGE} (source {part.name})")
        entry = {**part.describe(), **counts.as_dict(), "source_rows": tally.source_rows}
        if part.weight is not None and tally.source_rows < part.quota:  # a mix entry holding less than its share
            entry["short"] = part.quota - tally.source_rows
        out.append(entry)
    return out


def _write_shards(
    data: DataConfig, parts: list[Part], layout: RunLayout, log: logging.Logger
) -> tuple[list[_Tally], list[dict]]:
    out = layout.prompts
    tmps = [out / f".{shard_name(k)}.partial" for k in range(data.num_shards)]
    writers = [_ShardWriter(t, mixed=bool(data.mix)) for t in tmps]
    try:
        with atomic_path(layout.prompts_rejected) as rej_tmp, open(rej_tmp, "w", encoding="utf-8") as rejected_fh:
            tallies = _stream(data, parts, writers, rejected_fh)
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
    return tallies, shards


def _remove_stale(layout: RunLayout, keep: set[str], log: logging.Logger) -> None:
    for path in layout.prompts.glob("shard-*.parquet"):
        if path.name not in keep:
            log.warning("prepare: removing %s left from an earlier run with more shards", path.name)
            remove_inside(path, layout.root, missing_ok=False)


def _described(data: DataConfig, parts: list[Part]) -> str:
    """The run's source as the manifest and messages name it."""
    if data.mix:
        return "mix: " + ", ".join(p.name for p in parts)
    if data.preset is not None:
        return f"preset {data.preset}: {parts[0].source.spec}"
    return data.source


def _rejection_error(data: DataConfig, parts: list[Part], tally: _Tally, layout: RunLayout) -> str | None:
    if tally.in_ == 0:
        return f"prepare: data.source {_described(data, parts)!r} holds no rows"
    if tally.invalid / tally.in_ > data.max_rejected_fraction:
        top = ", ".join(f"{k}={n}" for k, n in tally.reasons.most_common(3))
        return (
            f"prepare: {tally.invalid} of {tally.in_} candidate prompts were rejected as invalid "
            f"({tally.invalid / tally.in_:.0%} > data.max_rejected_fraction={data.max_rejected_fraction}); "
            f"top reasons: {top}; every rejected row is listed in {layout.prompts_rejected}"
        )
    return None


def _parts(config: PipelineConfig) -> list[Part]:
    """The configured sources; for self:prompts, the prompts the target wrote (the prepare flow writes them first)."""
    from eagle3.prepare import self_prompts

    data = config.data
    if data.preset is not None or data.mix or not self_prompts.is_self_source(data.source):
        return plan(data)
    layout = RunLayout.of(config)
    if read_marker(layout.self_prompts_marker, self_prompts.STAGE) is None:
        raise PrepareError(
            f"prepare: data.source={data.source!r} needs the prompts the target writes, and "
            f"{layout.self_prompts_marker} does not exist; run the prepare flow (eagle3 prepare / eagle3 run), "
            "which serves the target and writes them first"
        )
    return plan(data, str(layout.self_prompts_file))


def run_prepare(config: PipelineConfig, logger: logging.Logger | None = None) -> PrepareResult:
    """Run the stage into ``RUN/prompts``; skip when the completion marker is current."""
    log = logger or logging.getLogger(__name__)
    data = config.data
    layout = RunLayout.of(config)
    out = layout.prompts
    out.mkdir(parents=True, exist_ok=True)
    parts = _parts(config)
    fingerprint = _fingerprint(data, parts)
    done = _up_to_date(layout, fingerprint)
    if done is not None:
        log.info("prepare: up to date (%s), nothing to do", done.path)
        return PrepareResult(str(out), tuple(s["name"] for s in done["shards"]), _entry(done), fingerprint, True)
    remove_marker(layout.prompts_marker, config.run_dir)
    for leftover in [*out.glob(".*.partial"), *out.glob(".*.tmp")]:
        remove_inside(leftover, config.run_dir, missing_ok=False)  # temporary files of a run that was killed
    tallies, shards = _write_shards(data, parts, layout, log)
    _remove_stale(layout, {s["name"] for s in shards}, log)
    tally = _Tally()
    for part_tally in tallies:
        tally.add(part_tally)
    counts = tally.counts()
    error = _rejection_error(data, parts, tally, layout)
    entry = record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="failed" if error else "ok",
        error=error,
        config_hash=data.config_hash(),
        fingerprint=fingerprint,
        source=_described(data, parts),
        source_rows=tally.source_rows,
        sources=_per_source(parts, tallies),
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
    if data.mix:
        for source in entry["sources"]:
            short = f", {source['short']} short of its quota" if "short" in source else ""
            log.info(
                "prepare: source %s: %d rows -> %d prompts, %d filtered (%s)%s",
                source["name"],
                source["source_rows"],
                source["ok"],
                source["filtered"],
                source["reasons"],
                short,
            )
    return PrepareResult(str(out), tuple(s["name"] for s in shards), entry, fingerprint, False)


def summary_line(result, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    run = Path(run_dir)
    return f"prompts:      {run / 'prompts'}  (rejected rows and reasons: {run / 'prompts' / 'rejected.jsonl'})"
