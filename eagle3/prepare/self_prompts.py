"""Prompts the target writes itself (``data.source = "self:prompts"``, Magpie-style).

The chat template's text up to the start of a user turn goes to the server's ``/v1/completions``
with ``n`` samples per request and stops at the end of the turn: each sample is a user request
the target considers likely. They are filtered (too_long: ran to max_tokens; empty; too_short;
duplicate; near_duplicate) and the kept ones become ``RUN/prompts/self/prompts.jsonl``, which the
prepare stage then reads like any local file (ids, shards, its own checks).

Design choices:
- Request ``i`` is fully determined by its index: system prompt ``i mod len``, the opening of
  its user turn ``user_starts[i mod len]`` (if any; the kept prompt is the opening plus what the
  target wrote, and only what it wrote is filtered), seed
  ``seed + i * n`` (vLLM seeds its n samples ``seed + i * n + k``: no seed is used twice).
  Every finished request is appended (flushed, fsynced every generation.fsync_every) to
  ``requests-KEY.jsonl`` as it arrives; KEY hashes what decides the answers (model, the
  prefixes and stops, the openings, temperature, top_p, max_tokens, n, seed). A rerun -- after a kill,
  or with a larger count -- reuses every finished request and asks only the missing ones;
  a change of sampling settings starts a new file instead of mixing answers.
- Selection runs in request order, whatever order answers arrive in: candidates are judged
  request by request from index 0, the first ``count`` that pass are kept, the rest of the
  request that reached the count are filtered as ``surplus``, and later requests are not
  counted (their answers stay on disk for a larger count). So the result does not depend
  on concurrency or timing, and a resumed run equals an uninterrupted one.
- Requests go out only while the prompts expected from those in flight (at the yield seen
  so far) would not reach the count, so a small count does not start ``concurrency``
  requests; requests still in flight when the count is reached are cancelled.
- Accounting unit: one requested sample. ``in == ok + filtered + failed``; a request that
  failed after all attempts counts its n samples as failed (a rerun asks it again). Every
  filtered or failed sample is a line of ``rejected.jsonl`` with its kind and reason.
- The retry, backoff, deadline and replica policy is the generation client's
  (eagle3/serving/client.py), with this source's max_tokens for the derived deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3.config import GenerationConfig, PipelineConfig, SelfPromptsConfig, section_hash
from eagle3.durable import atomic_write_bytes, sha256_file
from eagle3.errors import UserError
from eagle3.layout import STAGE_MARKER, RunLayout
from eagle3.manifest import record_stage
from eagle3.markers import Marker, read_marker, write_marker
from eagle3.prepare.dedup import NearDuplicates
from eagle3.prepare.turn_prefix import TurnPrefix, derive_all
from eagle3.records import JsonlAppender, iter_records
from eagle3.results import StageCounts
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool, Stats, request_with_retries
from eagle3.tokenizer import load_tokenizer

SELF_SOURCE = "self:prompts"
STAGE = "self_prompts"
MARKER = STAGE_MARKER  # prompts/self/done.json
PROGRESS_EVERY_S = 15.0


class SelfPromptsError(UserError, RuntimeError):
    """The source ran but its result must not be used (too many failed requests, nothing kept)."""


def is_self_source(spec: str) -> bool:
    return spec == SELF_SOURCE


def out_dir(run_dir: str | Path) -> Path:
    return RunLayout.of(run_dir).self_prompts


def prompts_file(run_dir: str | Path) -> Path:
    return RunLayout.of(run_dir).self_prompts_file


# -- the plan: what each request asks -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Small and JSON-able (it crosses the task boundary): the prefixes and the settings key."""

    model: str
    prefixes: tuple[TurnPrefix, ...]
    key: str


def make_plan(facts: RunFacts) -> Plan:
    """Derive each system prompt's prefix from the target's own chat template (loads the tokenizer of
    the target's folder, ``facts.model_dir()``: the template the server renders, whatever
    tokenize.tokenizer names)."""
    config = facts.config
    sp = config.data.self_prompts
    prefixes = tuple(derive_all(load_tokenizer(facts.model_dir()), list(sp.system_prompts), config.server.model))
    decides = {
        "model": config.server.model,
        "prefixes": [asdict(p) for p in prefixes],
        "sampling": sp.model_dump(include={"temperature", "top_p", "max_tokens", "n", "seed", "seeded"}),
    }
    if sp.user_starts:  # off: the key of the runs written before the knob
        decides["user_starts"] = list(sp.user_starts)
    key = hashlib.sha256(json.dumps(decides, sort_keys=True).encode()).hexdigest()[:16]
    return Plan(config.server.model, prefixes, key)


def request_seed(sp: SelfPromptsConfig, index: int) -> int | None:
    """None when requests go unseeded (data.self_prompts.seeded = false)."""
    return sp.seed + index * sp.n if sp.seeded else None


def user_start(sp: SelfPromptsConfig, index: int) -> str:
    """The opening of request ``index``'s user turn ('' when data.self_prompts.user_starts is off)."""
    return sp.user_starts[index % len(sp.user_starts)] if sp.user_starts else ""


def request_body(plan: Plan, sp: SelfPromptsConfig, index: int, model: str) -> dict:
    turn = plan.prefixes[index % len(plan.prefixes)]
    body = {
        "model": model,
        "prompt": turn.prefix + user_start(sp, index),
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "n": sp.n,
        "stop": [turn.stop],
        "add_special_tokens": False,  # the prefix carries the template's BOS already
    }
    if sp.seeded:
        body["seed"] = request_seed(sp, index)
    if turn.stop_token_ids:
        body["stop_token_ids"] = list(turn.stop_token_ids)
    return body


def max_requests(sp: SelfPromptsConfig) -> int:
    return sp.max_requests or 4 * math.ceil(sp.count / sp.n)


def _filters_hash(sp: SelfPromptsConfig) -> str:
    """What decides the kept set besides the answers (concurrency does not: selection runs in request order).
    Keys added later are left out at their defaults, so a run written before them keeps its marker."""
    later = {k for k, default in sp.LATER_KEYS.items() if getattr(sp, k) == default}
    return hashlib.sha256(sp.model_dump_json(exclude={"concurrency", *later}).encode()).hexdigest()[:16]


# -- selection, in request order --------------------------------------------------------------------


@dataclass
class Selector:
    """Judges requests in index order: keeps up to ``count`` requests that pass every filter."""

    sp: SelfPromptsConfig
    plan: Plan
    kept: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    reasons: Counter = field(default_factory=Counter)
    candidates: int = 0
    failed: int = 0
    requests: int = 0
    dedup: NearDuplicates | None = None

    def __post_init__(self) -> None:
        self.dedup = NearDuplicates(self.sp.near_duplicate_threshold)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.sp.count

    def feed(self, record: dict) -> None:
        self.requests += 1
        if "failed" in record:
            self._failed(record)
            return
        for k, choice in enumerate(record["choices"]):
            self.candidates += 1
            self._judge(record, k, choice)

    def _failed(self, record: dict) -> None:
        failure = record["failed"]
        for k in range(self.sp.n):
            self.candidates += 1
            self.failed += 1
            self._reject(
                record["request"],
                k,
                "request_failed",
                f"{failure['kind']}: {failure['message']} (after {record['attempts']} attempts)",
            )

    def _reject(self, request: int, choice: int, kind: str, reason: str, text: str | None = None) -> None:
        self.reasons[kind] += 1
        row = {"request": request, "choice": choice, "kind": kind, "reason": reason}
        if text is not None:
            row["text"] = text
        self.rejected.append(row)

    def _judge(self, record: dict, k: int, choice: dict) -> None:
        i, raw = record["request"], choice["text"]
        text = raw.strip()  # what the target wrote: the filters judge only this, never the opening
        if self.full:
            return self._reject(
                i, k, "surplus", f"data.self_prompts.count={self.sp.count} prompts were kept already", raw
            )
        if choice["finish_reason"] == "length":
            return self._reject(
                i, k, "too_long", f"ran to max_tokens={self.sp.max_tokens} without ending the user turn", raw
            )
        if not text:
            return self._reject(i, k, "empty", "the user turn ended at once")
        if len(text) < self.sp.min_chars:
            return self._reject(
                i, k, "too_short", f"{len(text)} characters < data.self_prompts.min_chars={self.sp.min_chars}", raw
            )
        match, token = self.dedup.check(text)
        if match is not None:
            other = self.kept[match.other]
            return self._reject(
                i,
                k,
                match.kind,
                f"like kept request {other['request']} choice {other['choice']} (similarity {match.similarity:.2f})",
                raw,
            )
        self.dedup.add(len(self.kept), token)
        turn = self.plan.prefixes[i % len(self.plan.prefixes)]
        start = user_start(self.sp, i)
        user = (start + raw).strip() if start else text
        self.kept.append({"messages": turn.messages(user), "request": i, "choice": k})

    def yield_per_request(self) -> float:
        return len(self.kept) / self.requests if self.requests else float(self.sp.n)

    def counts(self) -> StageCounts:
        return StageCounts(
            self.candidates,
            len(self.kept),
            self.failed,
            self.candidates - len(self.kept) - self.failed,
            dict(self.reasons),
        )


# -- the raw answers on disk ------------------------------------------------------------------------


def finished_requests(path: Path, key: str, logger: logging.Logger) -> dict[int, dict]:
    """Answered requests of an earlier run (failures are asked again)."""
    done: dict[int, dict] = {}
    for record in iter_records(path, logger):
        if record.get("key") != key:
            raise SelfPromptsError(
                f"{path}: a record of settings {record.get('key')!r} in the file of settings {key!r}; move the "
                "file aside"
            )
        if "failed" not in record:
            done.setdefault(record["request"], record)
    return done


def _record(
    plan: Plan, sp: SelfPromptsConfig, index: int, result: dict | None, failure, attempts: int, latency: float
) -> dict:
    base = {
        "request": index,
        "key": plan.key,
        "system": index % len(plan.prefixes),
        "seed": request_seed(sp, index),
        "attempts": attempts,
    }
    if sp.user_starts:
        base["start"] = index % len(sp.user_starts)
    if failure is not None:
        return {**base, "failed": {"kind": failure.kind, "message": failure.message}}
    return {**base, "choices": result["choices"], "usage": result.get("usage"), "latency_s": round(latency, 3)}


# -- asking ---------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One collection: the requests in flight and the in-order frontier over finished ones."""

    config: PipelineConfig
    plan: Plan
    pool: EndpointPool
    model: str
    out: JsonlAppender
    log: logging.Logger
    selector: Selector
    finished: dict[int, dict]
    stats: Stats = field(default_factory=Stats)
    frontier: int = 0
    asked: int = 0
    in_flight: dict[asyncio.Task, int] = field(default_factory=dict)

    @property
    def sp(self) -> SelfPromptsConfig:
        return self.config.data.self_prompts

    def advance(self) -> None:
        while self.frontier in self.finished and not self.selector.full:
            self.selector.feed(self.finished[self.frontier])
            self.frontier += 1

    def want_more(self, next_index: int) -> bool:
        outstanding = next_index - self.frontier  # started or on disk, not yet judged
        expected = len(self.selector.kept) + outstanding * self.selector.yield_per_request()
        return (
            next_index < max_requests(self.sp)
            and expected < self.sp.count
            and len(self.in_flight) < self.sp.concurrency
        )

    async def ask(self, index: int, gen: GenerationConfig) -> dict:
        body = request_body(self.plan, self.sp, index, self.model)
        rng = random.Random(f"{self.sp.seed}:{index}")  # backoff jitter, reproducible per request
        self.stats.in_flight += 1
        try:
            result, failure, attempts, latency = await request_with_retries(
                self.pool, body, gen, self.stats, rng, route="completions"
            )
        finally:
            self.stats.in_flight -= 1
        return _record(self.plan, self.sp, index, result, failure, attempts, latency)

    def land(self, record: dict) -> None:
        """An answer arrived: durably on disk first (failures too, for the record), then in order."""
        due = self.out.append(record, sync=False)
        if due:
            self.out.sync()
        self.asked += 1
        if "failed" in record:
            self.stats.failed += 1
            self.stats.errors[record["failed"]["kind"]] += 1
        else:
            self.stats.done += 1
        self.finished[record["request"]] = record
        self.advance()


async def _collect(run: _Run, gen: GenerationConfig) -> None:
    index, last_log = 0, time.monotonic()
    try:
        while True:
            run.advance()
            if run.selector.full or (index >= max_requests(run.sp) and not run.in_flight and run.frontier >= index):
                return
            if run.want_more(index):
                if index not in run.finished:
                    run.in_flight[asyncio.ensure_future(run.ask(index, gen))] = index
                index += 1
                continue
            if not run.in_flight:  # nothing to wait for, and no more wanted: the frontier caught up
                return
            done, _ = await asyncio.wait(run.in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=run.in_flight.__getitem__):
                del run.in_flight[task]
                run.land(task.result())
            if time.monotonic() - last_log > PROGRESS_EVERY_S:
                last_log = time.monotonic()
                run.log.info(
                    "self_prompts: %d kept of %d wanted, %d requests asked, %d in flight",
                    len(run.selector.kept),
                    run.sp.count,
                    run.asked,
                    len(run.in_flight),
                )
    finally:
        for task in run.in_flight:  # only surplus would come back: cancel, they are not counted
            task.cancel()
        await asyncio.gather(*run.in_flight, return_exceptions=True)


# -- the whole step -----------------------------------------------------------------------------------


def marker_current(config: PipelineConfig, plan: Plan) -> Marker | None:
    """The completion marker when it matches these settings and prompts.jsonl is what it wrote."""
    layout = RunLayout.of(config)
    done = read_marker(layout.self_prompts_marker, STAGE)
    if done is None or not layout.self_prompts_file.exists():
        return None
    if done.key != plan.key or done.get("filters") != _filters_hash(config.data.self_prompts):
        return None
    return done if sha256_file(layout.self_prompts_file) == done.get("prompts_sha256") else None


def _write_if_changed(path: Path, data: bytes) -> None:
    """Rewrite only when the bytes differ: an unchanged file keeps its mtime, so prepare's input fingerprint holds."""
    if not (path.exists() and path.read_bytes() == data):
        atomic_write_bytes(path, data)


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def _finish(config: PipelineConfig, plan: Plan, run: _Run, log: logging.Logger) -> dict:
    sp, sel, layout = config.data.self_prompts, run.selector, RunLayout.of(config)
    _write_if_changed(layout.self_prompts_rejected, _jsonl(sel.rejected))
    _write_if_changed(layout.self_prompts_file, _jsonl(sel.kept))
    counts = sel.counts()
    error = _error(config, counts)
    entry = record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="failed" if error else "ok",
        error=error,
        wanted=sp.count,
        requests_judged=sel.requests,
        requests_asked=run.asked,
        requests_on_disk=len(run.finished),
        raw_file=str(layout.self_prompts_requests(plan.key)),
        prefixes=[asdict(p) for p in plan.prefixes],
        config_hash=section_hash(sp),
    )
    if error:
        raise SelfPromptsError(error)
    if len(sel.kept) < sp.count:
        log.warning(
            (
                "self_prompts: only %d of %d wanted prompts passed the filters within %d requests "
                "(data.self_prompts.max_requests); reasons: %s"
            ),
            len(sel.kept),
            sp.count,
            max_requests(sp),
            dict(sel.reasons),
        )
    write_marker(
        layout.self_prompts_marker,
        STAGE,
        plan.key,
        counts.as_dict(),
        filters=_filters_hash(sp),
        prompts_sha256=sha256_file(layout.self_prompts_file),
        manifest_entry=entry,
    )
    log.info(
        "self_prompts: %d prompts kept of %d samples (%d requests, %d asked now); filtered %s",
        len(sel.kept),
        counts.in_,
        sel.requests,
        run.asked,
        dict(sel.reasons),
    )
    return entry


def _error(config: PipelineConfig, counts: StageCounts) -> str | None:
    where = RunLayout.of(config).self_prompts_rejected
    if counts.in_ and counts.failed / counts.in_ > config.generation.max_failure_fraction:
        return (
            f"self_prompts: {counts.failed} of {counts.in_} samples failed ({counts.failed / counts.in_:.0%} > "
            f"generation.max_failure_fraction={config.generation.max_failure_fraction}); reasons in {where}; a "
            "rerun asks them again"
        )
    if counts.ok == 0:
        return f"self_prompts: no prompt passed the filters ({counts.in_} samples: {counts.reasons}); see {where}"
    return None


async def collect(
    config: PipelineConfig, plan: Plan, pool: EndpointPool, model: str, logger: logging.Logger | None = None
) -> dict:
    """Ask the served target for user turns until data.self_prompts.count pass the filters; write the outputs."""
    log = logger or logging.getLogger(__name__)
    sp, layout = config.data.self_prompts, RunLayout.of(config)
    layout.self_prompts.mkdir(parents=True, exist_ok=True)
    raw = layout.self_prompts_requests(plan.key)
    finished = finished_requests(raw, plan.key, log)
    if finished:
        log.info("self_prompts: %d requests answered on disk (%s) are reused", len(finished), raw)
    gen = config.generation.model_copy(update={"max_tokens": sp.max_tokens})
    with JsonlAppender(
        raw, config.generation.fsync_every, "self-prompt request", config.generation.fsync_min_interval_s
    ) as out:
        run = _Run(config, plan, pool, model, out, log, Selector(sp, plan), finished)
        await _collect(run, gen)
    return _finish(config, plan, run, log)
