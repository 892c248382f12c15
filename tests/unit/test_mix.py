"""Mixing sources with weights (data.mix): shares, determinism, per-source counts, reruns."""

from fractions import Fraction
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from source_fixtures import FIXTURES, FakeHub, config, rejected, write_jsonl

from eagle3.manifest import read_manifest
from eagle3.prepare.mix import quotas
from eagle3.prepare.sources import SourceError
from eagle3.prepare.stage import run_prepare
from eagle3.run_facts import RunFacts
from eagle3.schemas import PROMPT_COLUMNS, check_schema


@pytest.fixture()
def hub(monkeypatch):
    import datasets

    fake = FakeHub([{"messages": [{"role": "user", "content": f"question {k}"}]} for k in range(40)])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    return fake


def test_quotas_follow_the_weights_and_add_up():
    assert quotas([Fraction(1), Fraction(1), Fraction(2)], 10) == [3, 2, 5]  # 2.5, 2.5, 5: the tie goes first
    assert quotas([Fraction(1), Fraction(3)], 100) == [25, 75]
    assert quotas([Fraction(1), Fraction(1), Fraction(1)], 2) == [1, 1, 0]
    for budget in range(0, 50):
        weights = [Fraction(w) for w in (0.2, 0.7, 1.3)]
        got = quotas(weights, budget)
        assert sum(got) == budget
        assert all(abs(q - budget * w / sum(weights)) < 1 for q, w in zip(got, weights))


def _sources(tmp_path, sizes: dict[str, int]) -> dict[str, Path]:
    return {
        name: write_jsonl(
            tmp_path / f"{name}.jsonl",
            [{"messages": [{"role": "user", "content": f"{name} prompt {k}"}]} for k in range(n)],
        )
        for name, n in sizes.items()
    }


def _mix(paths: dict[str, Path], weights: dict[str, float]) -> str:
    entries = ", ".join(f'{{source="{paths[n]}", name="{n}", weight={w}}}' for n, w in weights.items())
    return f"data.mix=[{entries}]"


def _by_source(run) -> dict[str, list]:
    out: dict[str, list] = {}
    for path in sorted((Path(run) / "prompts").glob("shard-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            out.setdefault(row["source"], []).append((row["source_index"], row["messages"][0]["content"]))
    return {k: sorted(v) for k, v in out.items()}


def test_mix_with_limit_gives_the_weighted_shares(tmp_path):
    paths = _sources(tmp_path, {"a": 100, "b": 50, "c": 200})
    mix = _mix(paths, {"a": 1, "b": 1, "c": 2})
    run = tmp_path / "run"
    run_prepare(config(run, mix, "data.limit=100"))
    got = _by_source(run)
    assert {k: len(v) for k, v in got.items()} == {"a": 25, "b": 25, "c": 50}
    assert all(content.startswith(f"{name} prompt ") for name, rows in got.items() for _, content in rows)
    entry = read_manifest(run)["stages"]["prepare"]
    per = {s["name"]: s for s in entry["sources"]}
    assert {n: (s["quota"], s["source_rows"], s["ok"]) for n, s in per.items()} == {
        "a": (25, 25, 25),
        "b": (25, 25, 25),
        "c": (50, 50, 50),
    }
    assert per["c"]["weight"] == 2.0 and entry["source"] == "mix: a, b, c"
    for key in ("in", "ok", "failed", "filtered"):
        assert entry[key] == sum(s[key] for s in entry["sources"])
    for path in (run / "prompts").glob("shard-*.parquet"):
        check_schema(path, PROMPT_COLUMNS, "prompt shard")  # the extra source column is allowed

    again = tmp_path / "again"
    run_prepare(config(again, mix, "data.limit=100"))
    assert _by_source(again) == got
    other = tmp_path / "other"
    run_prepare(config(other, mix, "data.limit=100", "data.seed=5"))
    assert _by_source(other) != got and {k: len(v) for k, v in _by_source(other).items()} == {"a": 25, "b": 25, "c": 50}


def test_mix_entry_order_does_not_change_its_sample(tmp_path):
    paths = _sources(tmp_path, {"a": 100, "b": 100})
    run_prepare(config(tmp_path / "ab", _mix(paths, {"a": 1, "b": 1}), "data.limit=40"))
    run_prepare(config(tmp_path / "ba", _mix(paths, {"b": 1, "a": 1}), "data.limit=40"))
    assert _by_source(tmp_path / "ab") == _by_source(tmp_path / "ba")


def test_mix_without_limit_takes_the_largest_proportional_mix(tmp_path):
    paths = _sources(tmp_path, {"a": 100, "b": 50, "c": 200})
    run = tmp_path / "run"
    run_prepare(config(run, _mix(paths, {"a": 1, "b": 1, "c": 2})))
    assert {k: len(v) for k, v in _by_source(run).items()} == {"a": 50, "b": 50, "c": 100}
    assert _by_source(run)["b"] == [(k, f"b prompt {k}") for k in range(50)]  # the scarcest source, whole


def test_a_short_source_gives_all_it_has_and_is_recorded(tmp_path):
    paths = _sources(tmp_path, {"a": 100, "b": 50, "c": 200})
    run = tmp_path / "run"
    run_prepare(config(run, _mix(paths, {"a": 1, "b": 1, "c": 2}), "data.limit=400"))
    per = {s["name"]: s for s in read_manifest(run)["stages"]["prepare"]["sources"]}
    assert {n: (s["quota"], s["source_rows"], s.get("short")) for n, s in per.items()} == {
        "a": (100, 100, None),
        "b": (100, 50, 50),
        "c": (200, 200, None),
    }


def test_mix_counts_each_source_on_its_own(tmp_path):
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"messages": [{"role": "user", "content": "shared"}]},
            {"messages": []},
            {"messages": [{"role": "user", "content": "a"}]},
        ],
    )
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "shared"}]}, {"nothing": 1}])
    run = tmp_path / "run"
    # weights in proportion to the sizes (3, 4, 2 rows): without data.limit every row is read
    opc = FIXTURES / "opc.jsonl"
    mix = (
        f'data.mix=[{{source="{a}", name="a", weight=3}}, {{source="{opc}", preset="opc", weight=4}}, '
        f'{{source="{b}", name="b", weight=2}}]'
    )
    run_prepare(config(run, mix))
    entry = read_manifest(run)["stages"]["prepare"]
    per = {s["name"]: s for s in entry["sources"]}
    assert (per["a"]["ok"], per["a"]["reasons"]) == (2, {"empty": 1})
    assert (per["opc"]["ok"], per["opc"]["preset"], per["opc"]["quota"]) == (1, "opc", 4)
    assert per["opc"]["source_rows"] == 4 and per["b"]["source_rows"] == 2
    assert per["b"]["reasons"] == {"duplicate": 1, "no_conversation": 1} and per["b"]["ok"] == 0
    for s in entry["sources"]:
        assert s["in"] == s["ok"] + s["failed"] + s["filtered"]
    assert entry["in"] == sum(s["in"] for s in entry["sources"]) == entry["ok"] + entry["filtered"]
    dup = [r for r in rejected(run) if r["kind"] == "duplicate"]
    assert len(dup) == 1 and dup[0]["source"] == "b" and "source a, source_index 0" in dup[0]["reason"]
    assert all("source" in r for r in rejected(run))


def test_unmixed_runs_have_no_source_column(tmp_path):
    run = tmp_path / "run"
    run_prepare(config(run, 'data.preset="opc"', f'data.preset_source="{FIXTURES / "opc.jsonl"}"'))
    for path in (run / "prompts").glob("shard-*.parquet"):
        assert pq.read_schema(path).names == ["id", "messages", "source_index"]
    assert all("source" not in r for r in rejected(run))


def test_streamed_hub_source_in_a_mix_needs_a_limit(tmp_path, hub):
    with pytest.raises(SourceError, match="set data.limit"):
        run_prepare(config(tmp_path / "run", 'data.mix=[{source="org/set", streaming=true}, {source="org/other"}]'))


def test_missing_local_source_in_a_mix_names_it(tmp_path):
    with pytest.raises(SourceError, match="nowhere.jsonl"):
        run_prepare(config(tmp_path / "run", f'data.mix=[{{source="{tmp_path / "nowhere.jsonl"}"}}]'))


def test_mixed_rerun_is_skipped_and_a_new_weight_rebuilds(tmp_path):
    paths = _sources(tmp_path, {"a": 40, "b": 40})
    run = tmp_path / "run"
    first = run_prepare(config(run, _mix(paths, {"a": 1, "b": 1}), "data.limit=20"))
    again = run_prepare(config(run, _mix(paths, {"a": 1, "b": 1}), "data.limit=20"))
    assert again.skipped and again.fingerprint == first.fingerprint
    assert [s["ok"] for s in again.counts["sources"]] == [10, 10]
    changed = run_prepare(config(run, _mix(paths, {"a": 3, "b": 1}), "data.limit=20"))
    assert not changed.skipped and {k: len(v) for k, v in _by_source(run).items()} == {"a": 15, "b": 5}


def test_tokenize_counts_rows_and_tokens_per_source_of_a_mix(tmp_path):
    """A mixed run's tokenized rows and tokens are counted per source (the report's per-source table)."""
    from eagle3.records import JsonlAppender
    from eagle3.tokenize.stage import record, tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path
    from test_tokenize import server_record

    paths = _sources(tmp_path, {"chat": 6, "math": 3})
    run = tmp_path / "run"
    cfg = config(run, _mix(paths, {"chat": 2, "math": 1}), "data.num_shards=1")
    run_prepare(cfg)
    rows = pq.read_table(run / "prompts" / "shard-00000.parquet").to_pylist()
    tok = load_tokenizer(tokenizer_path(cfg))
    gen = run / "generations"
    gen.mkdir()
    with JsonlAppender(gen / "shard-00000.jsonl") as out:
        for k, row in enumerate(rows):
            rec = server_record(k, row, tok)
            if row["source"] == "math" and k == max(i for i, r in enumerate(rows) if r["source"] == "math"):
                rec["completion_token_ids"] = []  # one math row filtered as empty_completion
            out.append(rec)
    (gen / "shard-00000.done.json").write_text("{}")
    result = tokenize_shard(RunFacts.resolve(cfg), "shard-00000.parquet", tok)
    per = result.per_source
    assert (per["chat"]["in"], per["chat"]["ok"], per["chat"]["filtered"]) == (6, 6, 0)
    assert (per["math"]["in"], per["math"]["ok"], per["math"]["filtered"]) == (3, 2, 1)
    assert per["chat"]["tokens"] + per["math"]["tokens"] == result.tokens
    assert per["chat"]["supervised_tokens"] + per["math"]["supervised_tokens"] == result.supervised
    entry = record(RunFacts.resolve(cfg), [result])
    assert entry["per_source"] == per
