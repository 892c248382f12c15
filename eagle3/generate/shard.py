"""Generate one prompt shard: durable, resumable, every prompt accounted for.

Files per shard (``RUN/generations/``):
- ``shard-K.jsonl``          one record per finished prompt (the contract fields, docs/design.md)
- ``shard-K.filtered.jsonl`` finished but filtered (``finish_reason=length`` with keep_truncated off)
- ``shard-K.failed.jsonl``   one line per prompt that failed a run, with kind, message, attempts
- ``shard-K.meta.json``      the generation key the records were made with
- ``shard-K.done.json``      the completion marker: counts, input hash, key; written last

Design choices:
- The generation key hashes model, sampling, max_tokens and chat template. Records made
  under another key are moved aside (never deleted) into ``stale-KEY/`` and the shard
  starts over: new ``max_tokens`` means regenerate.
- Resume is by id: ids in the ok or filtered stream are done; everything else (never
  tried, or failed before) is sent again. The failure stream is append-only history;
  the shard's failed count is the ids whose last outcome was a failure.
- A lock file stops two runners from writing the same shard at once (which would be
  the one way to get duplicates).
- A write that fails (disk full) stops the shard with ``DiskWriteError`` naming the file and
  the free space; the file keeps only whole records and no marker is written, so the rerun
  resumes by id once there is space.
- The marker is complete only when no prompt is left failed with a *transient* error:
  an incomplete shard is resumed by the next attempt or run; permanent failures
  (400 prompt too long, ...) are final and counted.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from eagle3.config import GenerationConfig
from eagle3.durable import atomic_write_json, read_json, sha256_file, writing
from eagle3.errors import TransientError
from eagle3.generate.conversation import finished_turns, run_conversation, shortened_on_disk, turns_path
from eagle3.generate.samples import CYCLES, Sample, cycle_key_parts, expand, variant
from eagle3.layout import generation_files
from eagle3.markers import Marker, read_marker, remove_marker, write_marker
from eagle3.records import JsonlAppender, read_ids
from eagle3.schemas import PROMPT_COLUMNS, check_schema
from eagle3.serving.client import EndpointPool, Stats, deadline_s, request_with_retries


class ShardLockedError(TransientError, RuntimeError):
    """Another process is generating this shard right now."""


@dataclass(frozen=True)
class ShardResult:
    """What crosses the task boundary: counts and paths, never samples."""

    shard: str
    path: str
    in_: int
    ok: int
    failed: int
    filtered: int
    retryable: int
    errors: dict
    skipped: bool

    @property
    def complete(self) -> bool:
        return self.retryable == 0


def generation_key(
    model: str, gen: GenerationConfig, template_hash: str, regenerate: bool = False, extras: dict | None = None
) -> str:
    """What the records depend on. samples_per_prompt is not in it (raising it adds samples, the
    old ones stay valid); the cycles, the extra request fields and the regenerate mode are, but only
    when set, so a run made before they existed keeps its key."""
    parts = {
        "model": model,
        "max_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "template": template_hash,
        **cycle_key_parts(gen),
    }
    if regenerate:
        parts["turns"] = "regenerate"
    if extras:
        parts["extras"] = extras
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


STAGE = "generate"
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", *CYCLES, "samples_per_prompt")


def paths(out_dir: Path, shard_file: str) -> dict[str, Path]:
    p = generation_files(out_dir, shard_file)
    return {**p, "turns": turns_path(p["ok"])}


def load_prompts(shard_path: Path) -> list[tuple[str, list[dict]]]:
    """(id, messages) per prompt, after checking the shard has the prepare stage's columns."""
    check_schema(shard_path, PROMPT_COLUMNS, "prompt shard (RUN/prompts)")
    table = pq.read_table(shard_path, columns=["id", "messages"])
    return list(zip(table.column("id").to_pylist(), table.column("messages").to_pylist()))


def _result_from_marker(p: dict[str, Path], shard_file: str, marker: Marker) -> ShardResult:
    c = marker.counts
    return ShardResult(
        shard_file,
        str(p["ok"]),
        c["in"],
        c["ok"],
        c["failed"],
        c["filtered"],
        c["retryable"],
        marker.get("errors", {}),
        True,
    )


def _current_marker(p: dict[str, Path], key: str, input_sha: str, samples_per_prompt: int) -> Marker | None:
    marker = read_marker(p["done"], STAGE)
    if marker is None:
        return None
    ok = marker.key == key and marker.get("input_sha256") == input_sha and marker.counts["retryable"] == 0
    ok = ok and marker.get("samples_per_prompt", 1) == samples_per_prompt
    return marker if ok else None


def is_complete(
    shard_path: str | Path,
    out_dir: str | Path,
    gen: GenerationConfig,
    model: str,
    template_hash: str = "",
    regenerate: bool = False,
    extras: dict | None = None,
) -> bool:
    """Whether the shard's marker matches its prompts, the generation key and the sample count (nothing to send)."""
    shard_path = Path(shard_path)
    p = paths(Path(out_dir), shard_path.name)
    key = generation_key(model, gen, template_hash, regenerate, extras)
    return _current_marker(p, key, sha256_file(shard_path), gen.samples_per_prompt) is not None


def _set_aside_stale(p: dict[str, Path], key: str, log) -> None:
    """Records made under another generation key are kept, out of the way."""
    old = read_json(p["meta"]).get("key") if p["meta"].exists() else None
    if old is None or old == key:
        return
    stale = p["ok"].parent / f"stale-{old}"
    stale.mkdir(exist_ok=True)
    for name in ("ok", "filtered", "failed", "turns", "done"):
        if p[name].exists():
            shutil.move(str(p[name]), stale / p[name].name)
    log.warning(
        "%s: generation settings changed (key %s -> %s); earlier records moved to %s", p["ok"].name, old, key, stale
    )


class _Run:
    """The mutable state of one pass over a shard."""

    def __init__(self, samples, ok_ids, filtered_ids, turns_done, gen, model, pool, writers, stats, log, regenerate):
        self.todo = iter([s for s in samples if s.id not in ok_ids and s.id not in filtered_ids])
        self.ok_ids, self.filtered_ids = set(ok_ids), set(filtered_ids) - set(ok_ids)  # grown as records land
        self.turns_done = turns_done  # sample id -> finished turn records (regenerate mode)
        self.gen, self.model, self.pool, self.writers, self.stats, self.log = gen, model, pool, writers, stats, log
        self.regenerate = regenerate
        self.shortened: dict[str, str] = {}  # sample id -> why it ended early (regenerate mode; from disk, then grown)
        self.failed: dict[str, dict] = {}

    async def worker(self, rng: random.Random) -> None:
        for sample in self.todo:
            self.stats.in_flight += 1
            try:
                if self.regenerate:
                    await run_conversation(self, sample, rng)
                else:
                    await self.one(sample, rng)
            finally:
                self.stats.in_flight -= 1

    async def ask(self, messages: list[dict], sampling: dict, rng: random.Random):
        body = {"model": self.model, "messages": messages, **sampling, "return_token_ids": True}
        return await request_with_retries(self.pool, body, self.gen, self.stats, rng)

    async def one(self, sample: Sample, rng: random.Random) -> None:
        body = {"model": self.model, "messages": sample.messages, **sample.sampling, "return_token_ids": True}
        result, failure, attempts, latency = await request_with_retries(self.pool, body, self.gen, self.stats, rng)
        if failure is not None:
            await self.fail(sample, failure, attempts)
            return
        record = {"id": sample.id, **result, "sampling": sample.sampling, "attempts": attempts}
        record["latency_s"] = round(latency, 3)
        if sample.id != sample.prompt_id:
            record["prompt_id"] = sample.prompt_id
        self.stats.completion_tokens += len(result["completion_token_ids"] or [])
        if result["finish_reason"] == "length" and not self.gen.keep_truncated:
            await self.filtered(
                sample, {**record, "reason": "truncated: finish_reason=length and generation.keep_truncated=false"}
            )
        else:
            await self.ok(sample, record)

    async def fail(self, sample: Sample, failure, attempts: int, **where) -> None:
        record = {
            "id": sample.id,
            "error_kind": failure.kind,
            "message": failure.message,
            "attempts": attempts,
            "transient": failure.transient,
            "at": time.time(),
            **where,
        }
        await self.write("failed", record)
        self.failed[sample.id] = record
        self.stats.failed += 1
        self.stats.errors[failure.kind] += 1

    # A record counts once it is on disk: a write that fails raises before the id is counted.
    async def ok(self, sample: Sample, record: dict) -> None:
        await self.write("ok", record)
        self.stats.done += 1
        self.ok_ids.add(sample.id)

    async def filtered(self, sample: Sample, record: dict) -> None:
        await self.write("filtered", record)
        self.stats.filtered += 1
        self.filtered_ids.add(sample.id)

    async def write(self, stream: str, record: dict) -> None:
        """Append (flushed at once); the periodic fsync runs behind, in a worker thread (eagle3/records.py)."""
        writer = self.writers[stream]
        if writer.append(record, sync=False):
            writer.sync_behind()


async def _report(stats: Stats, every_s: float, progress: Callable[[dict], None]) -> None:
    while True:
        await asyncio.sleep(every_s)
        progress(stats.snapshot())


def _lock(p: dict[str, Path]):
    fh = open(p["lock"], "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise ShardLockedError(f"{p['ok']} is being generated by another process (lock {p['lock']})") from None
    return fh


def _done_ids(p: dict[str, Path], log) -> tuple[set[str], set[str]]:
    ok = read_ids(p["ok"], log)
    filtered = read_ids(p["filtered"], log)
    read_ids(p["failed"], log)  # repairs its tail too, before we append
    return ok, filtered


async def generate_shard(
    shard_path: str | Path,
    out_dir: str | Path,
    gen: GenerationConfig,
    model: str,
    pool: EndpointPool,
    template_hash: str = "",
    logger=None,
    progress: Callable[[dict], None] | None = None,
    progress_every_s: float = 10.0,
    concurrency: int | None = None,
    regenerate: bool = False,
    extras: dict | None = None,
) -> ShardResult:
    """Generate every sample of one shard that is not on disk yet; see the module docstring.

    regenerate: data.turns = "regenerate" (conversation.py); extras: request fields the reasoning
    mode adds to every request."""
    log = logger or logging.getLogger(__name__)
    shard_path, out_dir = Path(shard_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    p = paths(out_dir, shard_path.name)
    key, input_sha = generation_key(model, gen, template_hash, regenerate, extras), sha256_file(shard_path)
    lock = _lock(p)
    try:
        marker = _current_marker(p, key, input_sha, gen.samples_per_prompt)
        if marker is not None:
            log.info("%s: complete on disk, nothing to do", p["ok"].name)
            return _result_from_marker(p, shard_path.name, marker)
        prompts = load_prompts(shard_path)  # a shard with the wrong columns stops here, before anything moves
        _set_aside_stale(p, key, log)
        with writing(p["meta"], "generate"):
            meta = {"key": key, "model": model, "sampling": {k: getattr(gen, k) for k in SAMPLING_FIELDS}}
            atomic_write_json(p["meta"], {**meta, "regenerate": regenerate, "extras": extras or {}})
        remove_marker(p["done"], out_dir)
        ok_ids, filtered_ids = _done_ids(p, log)
        turns_done = finished_turns(p["turns"], log) if regenerate else {}
        samples = list(expand(prompts, gen, extras))
        run = _Run(samples, ok_ids, filtered_ids, turns_done, gen, model, pool, {}, None, log, regenerate)
        if regenerate:
            run.shortened = shortened_on_disk(p["ok"])
        return await _generate(
            p, shard_path.name, samples, run, key, input_sha, progress, progress_every_s, concurrency or gen.concurrency
        )
    finally:
        lock.close()


async def _generate(p, shard_file, samples, run: _Run, key, input_sha, progress, every_s, workers) -> ShardResult:
    gen, log = run.gen, run.log
    run.stats = stats = Stats(total=len(samples), skipped=len(run.ok_ids | run.filtered_ids))
    log.info(
        "%s: %d samples (%d per prompt), %d already on disk%s, deadline %.0f s per request",
        p["ok"].name,
        len(samples),
        gen.samples_per_prompt,
        stats.skipped,
        f", {sum(map(len, run.turns_done.values()))} turns of open conversations" if run.regenerate else "",
        deadline_s(gen),
    )
    streams = ("ok", "filtered", "failed", "turns") if run.regenerate else ("ok", "filtered", "failed")
    every, interval = gen.fsync_every, gen.fsync_min_interval_s
    run.writers = writers = {k: JsonlAppender(p[k], every, "generate", interval) for k in streams}
    reporter = asyncio.create_task(_report(stats, every_s, progress)) if progress else None
    tasks = [asyncio.create_task(run.worker(random.Random(f"{key}:{k}"))) for k in range(workers)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        # A failed write (disk full) or a cancellation: stop the other workers before their files
        # close, and raise the first error, not one from closing.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _close_all(writers, log, raise_first=False)
        raise
    finally:
        if reporter:
            reporter.cancel()
    _close_all(writers, log, raise_first=True)  # the last fsync; a failure raises DiskWriteError before any marker
    return _finish(p, shard_file, samples, run, key, input_sha, log, progress)


def _turn_counts(run: _Run) -> dict:
    """Regenerate mode: conversations kept shorter (on disk, all passes) by reason, and this pass's turns."""
    reasons = Counter(r for i, r in run.shortened.items() if i in run.ok_ids)
    return {
        "shortened": sum(reasons.values()),
        "shortened_by_reason": dict(reasons),
        "turns_this_pass": run.stats.turns,
    }


def _close_all(writers: dict[str, JsonlAppender], log, raise_first: bool) -> None:
    """Close every writer even when one fails; the first failure is raised or, when an earlier
    error is already on its way up, only logged."""
    first = None
    for w in writers.values():
        try:
            w.close()
        except OSError as exc:
            first = first or exc
            if not raise_first:
                log.warning("%s", exc)
    if raise_first and first is not None:
        raise first


def _finish(p, shard_file, samples, run: _Run, key, input_sha, log, progress) -> ShardResult:
    # What was on disk at the start plus what this pass appended (no second read of the records).
    ok_ids, filtered_ids = run.ok_ids, run.filtered_ids - run.ok_ids
    ids = [s.id for s in samples]
    wanted = set(ids)
    failed = {i: r for i, r in run.failed.items() if i not in ok_ids and i not in filtered_ids}
    lost = wanted - ok_ids - filtered_ids - set(failed)
    if lost:  # cannot happen unless records vanish underneath us; say so rather than undercount
        raise RuntimeError(
            f"{p['ok'].name}: {len(lost)} samples have neither a record nor a failure (e.g. {sorted(lost)[:3]})"
        )
    # Per sampling variant, the samples that ended ok or filtered (the settings follow from the id).
    variants = Counter(variant(s.sampling) for s in samples if s.id in ok_ids or s.id in filtered_ids)
    counts = {
        "in": len(wanted),
        "ok": len(ok_ids & wanted),
        "filtered": len(filtered_ids & wanted),
        "failed": len(failed),
        "retryable": sum(1 for r in failed.values() if r["transient"]),
    }
    errors: dict[str, int] = {}
    for r in failed.values():
        errors[r["error_kind"]] = errors.get(r["error_kind"], 0) + 1
    snapshot = run.stats.snapshot()
    write_marker(
        p["done"],
        STAGE,
        key,
        counts,
        input_sha256=input_sha,
        errors=errors,
        retries=snapshot["retries"],
        stats=snapshot,
        samples_per_prompt=run.gen.samples_per_prompt,
        variants=dict(sorted(variants.items())),
        **({"turns": _turn_counts(run)} if run.regenerate else {}),
    )
    if progress:
        progress(snapshot)
    log.info(
        "%s: ok=%d filtered=%d failed=%d (retryable %d) of %d; %s",
        p["ok"].name,
        counts["ok"],
        counts["filtered"],
        counts["failed"],
        counts["retryable"],
        counts["in"],
        snapshot,
    )
    return ShardResult(
        shard_file,
        str(p["ok"]),
        counts["in"],
        counts["ok"],
        counts["failed"],
        counts["filtered"],
        counts["retryable"],
        errors,
        False,
    )
