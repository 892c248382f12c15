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
