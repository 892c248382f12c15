"""Typed stage results: the manifest entry round trip and the entry view."""

import json
from dataclasses import dataclass, field

import pytest

from eagle3.manifest import StageCounts
from eagle3.results import StageResult


@dataclass(frozen=True, kw_only=True)
class ShardyResult(StageResult):
    STAGE = "shardy"
    layer_ids: tuple[int, ...] = ()
    paths: dict[str, str] = field(default_factory=dict)
    tokens: int = 0


def test_a_result_round_trips_through_its_manifest_entry_keeping_unknown_keys():
    result = ShardyResult(
        counts=StageCounts(5, 3, 1, 1, {"too_long": 1}),
        config_hash="abc",
        layer_ids=(1, 2, 3),
        paths={"a": "/x"},
        tokens=99,
        extra={"written_by_a_newer_version": True},
    ).stamped()
    entry = json.loads(json.dumps(result.to_entry()))
    assert entry["in"] == 5 and entry["filtered"] == 1 and entry["reasons"] == {"too_long": 1}
    assert entry["layer_ids"] == [1, 2, 3] and entry["written_by_a_newer_version"] is True
    assert "error" not in entry and entry["recorded_at"].endswith("Z")
    back = ShardyResult.from_entry(entry)
    assert back.counts == result.counts and back.tokens == 99 and back.extra == {"written_by_a_newer_version": True}
    assert back.to_entry() == entry


def test_a_result_reads_as_its_manifest_entry():
    result = ShardyResult(counts=StageCounts(2, 2), tokens=7, status="failed", error="boom")
    assert result["ok"] == 2 and result["tokens"] == 7 and result["error"] == "boom"
    assert dict(result) == result.to_entry() and "tokens" in result and result.get("nope", 1) == 1
    with pytest.raises(KeyError):
        result["nope"]


def test_a_result_is_frozen_and_compares_by_value():
    result = ShardyResult(counts=StageCounts(1, 1), tokens=1)
    with pytest.raises(AttributeError):
        result.tokens = 2
    assert result == ShardyResult(counts=StageCounts(1, 1), tokens=1)


def test_a_stage_records_its_typed_result_and_refuses_an_undeclared_field(tmp_path):
    from eagle3.manifest import record_stage
    from eagle3.report import stage_results
    from eagle3.results import VocabStageResult

    result = record_stage(tmp_path, "vocab", StageCounts(4, 4), draft_vocab_size=8, coverage=0.5, identity=False)
    assert isinstance(result, VocabStageResult) and result.draft_vocab_size == 8 and result["coverage"] == 0.5
    read_back = stage_results(tmp_path)["vocab"]
    assert isinstance(read_back, VocabStageResult) and read_back.coverage == 0.5 and read_back.recorded_at
    with pytest.raises(TypeError, match="stage vocab: VocabStageResult cannot hold these fields"):
        record_stage(tmp_path, "vocab", StageCounts(1, 1), colour="blue")


def test_every_registered_stage_names_a_result_class_for_itself():
    from eagle3 import stages

    for stage in stages.STAGES:
        cls = stages.resolve(stage.result)
        assert issubclass(cls, StageResult) and cls.STAGE == stage.name, stage.name
