"""Typed stage results: what a stage did, as one small frozen value.

A stage's run returns one; the same object becomes its manifest entry (``to_entry``), is read
back from the manifest by ``eagle3 status`` and the report (``from_entry``), and is what the
Prefect task publishes as artifacts and returns. Only references cross a task boundary: counts,
paths, hashes and versions, never data.

Every stage's class is below, one place that reads as the contract of the manifest; the registry
(``eagle3/stages.py``) names each stage's class, and ``eagle3.manifest.record_stage`` builds it, so a
field a stage records but its class does not declare is an error, not a silent extra key. Keys a
manifest holds that the class does not know (an older or newer version wrote them) are kept in
``extra`` and written back unchanged. Optional fields left at None are not written.

A result also reads as its manifest entry (``result["ok"]``, ``dict(result)``): the shape the
manifest, the Prefect artifacts and code written against the manifest use.

Its counts (``StageCounts``: rows in, and where each went) live here with the results that carry
them, below the manifest that writes both.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from eagle3 import stages
from eagle3.errors import PermanentError

COUNT_KEYS = ("in", "ok", "failed", "filtered", "reasons")
R = TypeVar("R", bound="StageResult")


class AccountingError(PermanentError, RuntimeError):
    """A stage's counts do not add up: rows were lost."""


@dataclass(frozen=True)
class StageCounts:
    """Rows into a stage and where each one went."""

    in_: int
    ok: int
    failed: int = 0
    filtered: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def check(self, stage: str) -> None:
        if self.in_ != self.ok + self.failed + self.filtered:
            raise AccountingError(
                f"stage {stage}: in={self.in_} but ok={self.ok} + failed={self.failed} + "
                f"filtered={self.filtered} = {self.ok + self.failed + self.filtered}: rows were lost"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "in": self.in_,
            "ok": self.ok,
            "failed": self.failed,
            "filtered": self.filtered,
            "reasons": dict(sorted(self.reasons.items())),
        }


@dataclass(frozen=True, kw_only=True)
class StageResult(Mapping):
    """The fields every stage records; a subclass adds its own after them."""

    STAGE: ClassVar[str] = ""

    counts: StageCounts
    status: str = "ok"
    error: str | None = None
    config_hash: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    recorded_at: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.to_entry()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_entry())

    def __len__(self) -> int:
        return len(self.to_entry())

    def stamped(self: R) -> R:
        """This result with the time it is recorded."""
        return dataclasses.replace(self, recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def to_entry(self) -> dict[str, Any]:
        """The manifest entry: the counts flat at the top, then every field but the empty optional ones."""
        entry = self.counts.as_dict()
        for f in dataclasses.fields(self):
            if f.name in ("counts", "extra"):
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            entry[f.name] = _plain(value)
        return {**entry, **self.extra}

    @classmethod
    def from_entry(cls: type[R], entry: Mapping[str, Any]) -> R:
        """Read a manifest entry back; unknown keys go to ``extra``, missing optional ones keep defaults."""
        counts = StageCounts(
            entry["in"], entry["ok"], entry.get("failed", 0), entry.get("filtered", 0), dict(entry.get("reasons") or {})
        )
        known = {f.name for f in dataclasses.fields(cls)} - {"counts", "extra"}
        kwargs = {k: entry[k] for k in known if k in entry}
        extra = {k: v for k, v in entry.items() if k not in known and k not in COUNT_KEYS}
        return cls(counts=counts, extra=extra, **kwargs)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, mappings as dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- one class per stage (fields in the order the manifest shows them) -----------------------------


@dataclass(frozen=True, kw_only=True)
class PrepareStageResult(StageResult):
    STAGE = "prepare"
    fingerprint: str = ""  # hash of the source files and settings; a match means nothing to redo
    source: str = ""
    source_rows: int = 0
    shards: tuple[int, ...] = ()  # rows per prompt shard
    # per source (one entry unless data.mix): its settings (name, source, preset, split, weight, quota) and
    # its own in/ok/failed/filtered/reasons, which add up on their own and sum to the stage's counts
    sources: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class GenerateStageResult(StageResult):
    STAGE = "generate"
    model: str = ""  # the name requests used
    deadline_s: float = 0.0  # each request's total deadline
    replica_benches: Mapping[str, int] | None = None  # {replica URL: times benched}
    replicas_down_at_start: Mapping[str, str] | None = None
    server_restarts: int | None = None  # managed server only
    server_restart_events: tuple[Mapping[str, Any], ...] | None = None
    # server.replicas > 1: URL, node, restarts, lost (local replicas: cpu_bind too)
    server_replicas: tuple[Mapping[str, Any], ...] | None = None
    samples_per_prompt: int = 1  # counts are of samples: prompts x samples_per_prompt
    turns: str = "last_turn"  # data.turns; "regenerate": a sample is a whole conversation
    reasoning: str = "keep"  # generation.reasoning: keep | drop | disable
    variants: Mapping[str, int] = field(default_factory=dict)  # samples per sampling variant
    shortened: Mapping[str, int] | None = None  # regenerate: conversations kept shorter, by reason


@dataclass(frozen=True, kw_only=True)
class TokenizeStageResult(StageResult):
    STAGE = "tokenize"
    tokenizer: str = ""
    tokens: int = 0
    supervised_tokens: int = 0
    truncated_rows: int = 0
    template_check: Mapping[str, Any] = field(default_factory=dict)  # chat template vs server ids
    per_source: Mapping[str, Mapping[str, int]] | None = None  # data.mix runs: rows and tokens per source


@dataclass(frozen=True, kw_only=True)
class VocabStageResult(StageResult):
    STAGE = "vocab"
    path: str = ""  # draft_vocab.safetensors
    draft_vocab_size: int = 0
    target_vocab_size: int = 0
    coverage: float = 0.0  # share of supervised tokens the draft vocabulary holds
    identity: bool = False
    supervised_tokens: int = 0
    counted: str = ""  # what in/ok count


@dataclass(frozen=True, kw_only=True)
class ExtractStageResult(StageResult):
    STAGE = "extract"
    mode: str = "offline"
    backend: str = "hf"
    layer_ids: tuple[int, ...] = ()
    hidden_size: int = 0
    storage_dtype: str = "bfloat16"  # how offline mode stored the states (entries before fp8 existed: bf16)
    tokens: int = 0
    bytes: int = 0
    model_fingerprint: str = ""


@dataclass(frozen=True, kw_only=True)
class TrainStageResult(StageResult):
    STAGE = "train"
    counted: str = ""  # what in/ok count (optimizer steps)
    total_steps: int = 0
    best: Mapping[str, Any] | None = None  # the best checkpoint by held-out acceptance length
    tokens: int = 0
    world_size: int = 1
    layer_ids: tuple[int, ...] = ()
    checkpoints: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ExportStageResult(StageResult):
    STAGE = "export"
    checkpoint: str = ""
    step: int | None = None
    chosen_by: str = ""
    target: str = ""
    paths: Mapping[str, str] = field(default_factory=dict)  # {layout: folder}
    reused: tuple[str, ...] = ()
    skipped: Mapping[str, Any] = field(default_factory=dict)  # {layout: reasons}
    problems: Mapping[str, Any] = field(default_factory=dict)  # {layout: validation problems}


@dataclass(frozen=True, kw_only=True)
class EvaluateStageResult(StageResult):
    STAGE = "evaluate"
    path: str = ""  # live.json
    headline: Mapping[str, Any] | None = None
    headline_all_temperatures: Mapping[str, Any] = field(default_factory=dict)
    mean_acceptance_length: Mapping[str, Any] | None = None  # {temperature: value}
    acceptance_rate: Mapping[str, Any] | None = None
    untrained_mean_acceptance_length: Mapping[str, Any] | None = None
    offline_acceptance_length: float | None = None
    prompt_sets: Mapping[str, Any] = field(default_factory=dict)


def result_class(stage: str) -> type[StageResult]:
    """The registry's result class for ``stage``; the generic base for an entry no stage declares."""
    for declared in stages.STAGES:
        if declared.name == stage:
            return stages.resolve(declared.result)
    return StageResult


def build(stage: str, counts: StageCounts, fields: Mapping[str, Any]) -> StageResult:
    """The stage's typed result from what it records; the generic base keeps unknown fields in ``extra``."""
    cls = result_class(stage)
    if cls is StageResult:
        base = {f.name for f in dataclasses.fields(StageResult)} - {"counts", "extra"}
        known = {k: v for k, v in fields.items() if k in base}
        return StageResult(counts=counts, extra={k: v for k, v in fields.items() if k not in base}, **known)
    try:
        return cls(counts=counts, **fields)
    except TypeError as exc:  # a field the class does not declare: a bug in the stage, named
        raise TypeError(f"stage {stage}: {cls.__name__} cannot hold these fields: {exc}") from None
