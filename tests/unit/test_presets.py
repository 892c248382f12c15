"""Dataset presets, hub arguments (subset, split, streaming), streamed reading and weighted mixes.

Nothing is fetched: each preset reads a small file in its dataset's schema (tests/fixtures/presets),
and the hub loader is replaced by one that records its arguments and serves rows from memory.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.config import DEMO_RECIPE, ConfigError, DataConfig, load_config
from eagle3.manifest import read_manifest
from eagle3.prepare.mix import quotas
from eagle3.prepare.presets import PRESETS
from eagle3.prepare.sources import Source, SourceError, reservoir
from eagle3.prepare.stage import run_prepare
from eagle3.schemas import PROMPT_COLUMNS, check_schema

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "presets"


def config(run_dir, *sets):
    return load_config(
        DEMO_RECIPE, [f'run_dir="{run_dir}"', "data.num_shards=2", "data.max_rejected_fraction=1.0", *sets]
    )


def kept(run_dir) -> dict:
    """{source_index: messages as (role, content) pairs} over every shard."""
    out = {}
    for path in sorted((Path(run_dir) / "prompts").glob("shard-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            out[row["source_index"]] = [(m["role"], m["content"]) for m in row["messages"]]
    return out


def rejected(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "prompts" / "rejected.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- each preset maps its fixture to the expected conversations ------------------------------------

S, U, A = "system", "user", "assistant"
EXPECTED = {
    "sharegpt": (
        {
            0: [(U, "What is a B-tree?")],
            1: [(S, "Be brief."), (U, "Name a prime."), (A, "7"), (U, "Another one?")],
            6: [(U, "Explain DNS.\nBriefly.")],
        },
        {2: "leading_assistant", 3: "non_alternating", 4: "unknown_role", 5: "empty", 7: "duplicate"},
    ),
    "ultrachat": (
        {
            0: [(U, "How do tides work?"), (A, "The moon's gravity."), (U, "And the sun?")],
            1: [(U, "Write a haiku about rain.")],
        },
        {2: "empty", 3: "missing_column", 4: "unknown_role"},
    ),
    "magpie": (
        {
            0: [(U, "Explain recursion with an example in Python.")],
            2: [(U, "Compare TCP and UDP for a game server.")],
        },
        {1: "poor_input_quality", 3: "poor_input_quality", 4: "empty_content"},
    ),
    "openperfectblend": (
        {
            0: [(S, "You are a math tutor."), (U, "Solve 2x + 3 = 7.")],
            1: [(U, "Translate 'good night' into French.")],
        },
        {2: "leading_assistant", 3: "bad_conversation"},
    ),
    "openthoughts": (
        {
            0: [(U, "Find all real x with x^2 = 4.")],
            1: [(U, "How many primes are below 20?")],
        },
        {2: "unknown_role"},
    ),
    "opc": (
        {0: [(U, "Write a Python function that reverses a string.")]},
        {1: "non_string_content", 2: "missing_column", 3: "empty_content"},
    ),
}


def test_every_preset_has_a_fixture_and_an_expectation():
    assert set(EXPECTED) == set(PRESETS)
    assert {p.stem for p in FIXTURES.glob("*.jsonl")} == set(PRESETS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_maps_its_fixture(tmp_path, name):
    run = tmp_path / "run"
    run_prepare(config(run, f'data.preset="{name}"', f'data.preset_source="{FIXTURES / (name + ".jsonl")}"'))
    want_kept, want_rejected = EXPECTED[name]
    assert kept(run) == want_kept
    assert {r["source_index"]: r["kind"] for r in rejected(run)} == want_rejected
    entry = read_manifest(run)["stages"]["prepare"]
    assert entry["in"] == entry["ok"] + entry["failed"] + entry["filtered"]
    assert entry["ok"] == len(want_kept) and entry["filtered"] == len(want_rejected)
    reasons = {}
    for kind in want_rejected.values():
        reasons[kind] = reasons.get(kind, 0) + 1
    assert entry["reasons"] == reasons
    (source,) = entry["sources"]
    assert source["preset"] == name and source["reasons"] == reasons and source["ok"] == entry["ok"]
    assert entry["source"] == f"preset {name}: {FIXTURES / (name + '.jsonl')}"


def test_skips_are_documented_per_preset():
    assert PRESETS["sharegpt"].skips() == ["leading_assistant", "non_alternating"]
    assert PRESETS["magpie"].skips() == ["poor_input_quality"]
    assert PRESETS["ultrachat"].skips() == []


def test_preset_reads_parquet_like_jsonl(tmp_path):
    rows = [json.loads(line) for line in (FIXTURES / "ultrachat.jsonl").read_text().splitlines()]
    # The hub's parquet has one schema for every row: the row without messages gets a null there.
    table = pa.Table.from_pylist([{"messages": None, **r} for r in rows])
    (tmp_path / "copy").mkdir()
    pq.write_table(table, tmp_path / "copy" / "ultrachat.parquet")
    for streaming in ("false", "true"):
        run = tmp_path / f"run-{streaming}"
        run_prepare(
            config(
                run,
                'data.preset="ultrachat"',
                f'data.preset_source="{tmp_path / "copy"}"',
                f"data.streaming={streaming}",
            )
        )
        assert kept(run) == EXPECTED["ultrachat"][0]
        assert [r["kind"] for r in rejected(run)] == ["empty", "bad_conversation", "unknown_role"]


# -- config: unknown presets, conflicts, old configs ----------------------------------------------


def test_unknown_preset_fails_at_load_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ['data.preset="sharegtp"'])
    assert "data.preset" in str(err.value) and "sharegtp" in str(err.value)
    assert all(name in str(err.value) for name in PRESETS)
    with pytest.raises(ConfigError, match=r"data\.mix\.1\.preset: Input should be 'sharegpt', .* \(got 'nope'\)"):
        load_config(None, ['data.mix=[{preset="ultrachat"}, {preset="nope"}]'])


def test_unknown_preset_in_a_config_file_names_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[data]\npreset = "ultra"\n')
    with pytest.raises(ConfigError, match=r"run\.toml: data\.preset: Input should be 'sharegpt', .*'opc'"):
        load_config(path)


def test_mix_from_a_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "[data]\nlimit = 100\n"
        '[[data.mix]]\npreset = "ultrachat"\nweight = 3\n'
        '[[data.mix]]\nsource = "mine.jsonl"\nname = "mine"\n'
    )
    mix = load_config(path).data.mix
    assert [(m.label, m.weight) for m in mix] == [("ultrachat", 3.0), ("mine", 1.0)]


@pytest.mark.parametrize(
    "sets, message",
    [
        (['data.source="self:prompts"', 'data.mix=[{source="b.jsonl"}]'], "self:prompts cannot be mixed"),
        (['data.mix=[{source="a.jsonl"}, {source="a.jsonl"}]'], r"names \['a.jsonl'\] more than once"),
        (['data.mix=[{source="self:prompts"}]'], "cannot hold self:prompts"),
        (["data.mix=[{weight=0}]"], r"data\.mix\.0\.weight"),
        (['data.source="self:prompts"', 'data.preset="magpie"'], "pick one"),
        (['data.preset_source="x.jsonl"'], "needs data.preset"),
    ],
)
def test_bad_source_settings_fail_at_load(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)


def test_old_configs_hash_as_before():
    """Values from the release before these keys existed: an old run's prepare marker stays current."""
    assert DataConfig().config_hash() == "b08836f2499afdd9"
    assert load_config(DEMO_RECIPE).data.config_hash() == "b3294c730d06aca2"
    for sets in (
        ['data.preset="ultrachat"'],
        ['data.subset="x"'],
        ["data.streaming=true"],
        ['data.mix=[{source="a"}]'],
    ):
        assert load_config(DEMO_RECIPE, sets).data.config_hash() != "b3294c730d06aca2"


# -- hub arguments: subset, split, streaming ------------------------------------------------------


class FakeHub:
    """Stands in for datasets.load_dataset: records each call, serves ``rows`` (as a stream when asked)."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def __call__(self, path, **kwargs):
        import datasets

        self.calls.append((path, kwargs))
        ds = datasets.Dataset.from_list(self.rows)
        return ds.to_iterable_dataset() if kwargs.get("streaming") else ds


@pytest.fixture()
def hub(monkeypatch):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"question {k}"}]} for k in range(40)]
    fake = FakeHub(rows)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    return fake


def test_plain_hub_source_is_loaded_as_before(hub):
    Source("org/set", "train")
    assert hub.calls == [("org/set", {"split": "train"})]


@pytest.mark.parametrize(
    "sets, call",
    [
        (['data.source="org/set"', 'data.subset="chat"'], ("org/set", {"split": "train", "name": "chat"})),
        (
            ['data.preset="opc"'],
            ("OpenCoder-LLM/opc-sft-stage1", {"split": "train", "name": "largescale_diverse_instruct"}),
        ),
        (
            ['data.preset="opc"', 'data.subset="realuser_instruct"'],
            ("OpenCoder-LLM/opc-sft-stage1", {"split": "train", "name": "realuser_instruct"}),
        ),
        (['data.preset="ultrachat"'], ("HuggingFaceH4/ultrachat_200k", {"split": "train_sft"})),
        (['data.preset="ultrachat"', 'data.split="test_sft"'], ("HuggingFaceH4/ultrachat_200k", {"split": "test_sft"})),
        (['data.preset="magpie"', 'data.preset_source="org/magpie-copy"'], ("org/magpie-copy", {"split": "train"})),
        (['data.preset="opc"', 'data.preset_source="org/opc-copy"'], ("org/opc-copy", {"split": "train"})),
        (['data.source="org/set"', "data.streaming=true"], ("org/set", {"split": "train", "streaming": True})),
        (
            ['data.mix=[{preset="openthoughts", split="train"}]'],
            ("open-thoughts/OpenThoughts-114k", {"split": "train", "name": "default"}),
        ),
    ],
)
def test_hub_arguments(tmp_path, hub, sets, call):
    run_prepare(config(tmp_path / "run", *sets))
    assert hub.calls == [call]


def test_streamed_hub_limit_is_a_seeded_reservoir_sample(tmp_path, hub):
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        run = tmp_path / name
        run_prepare(config(run, 'data.source="org/set"', "data.streaming=true", "data.limit=10", f"data.seed={seed}"))
        runs[name] = kept(run)
    assert len(runs["a"]) == 10 and runs["a"] == runs["b"] and runs["a"] != runs["c"]
    assert all(messages == [("user", f"question {k}")] for k, messages in runs["a"].items())
    entry = read_manifest(tmp_path / "a")["stages"]["prepare"]
    assert entry["source_rows"] == 10 and entry["in"] == entry["ok"] == 10


def test_reservoir_is_uniform_and_in_order():
    hits = [0] * 10
    for seed in range(3000):
        picked = reservoir(iter(range(10)), 3, seed)
        assert [k for k, _ in picked] == sorted(k for k, _ in picked) and len(picked) == 3
        for k, item in picked:
            assert k == item
            hits[k] += 1
    assert all(abs(h / 3000 - 0.3) < 0.04 for h in hits), hits
    assert reservoir(iter(range(2)), 5, 0) == [(0, 0), (1, 1)]


# -- streaming local files --------------------------------------------------------------------------


def _big_parquet(path: Path, rows: int) -> int:
    text = "x" * 2000
    table = pa.Table.from_pylist([{"messages": [{"role": "user", "content": f"{k} {text}"}]} for k in range(rows)])
    pq.write_table(table, path, row_group_size=500, compression="zstd")
    return table.nbytes


def _peak_arrow_bytes(path: Path) -> int:
    """The most Arrow memory held at once while the rows of ``path`` are streamed."""
    source = Source(str(path), streaming=True)
    base, peak, count = pa.total_allocated_bytes(), 0, 0
    for _ in source.rows():
        count += 1
        if count % 50 == 0:
            peak = max(peak, pa.total_allocated_bytes() - base)
    assert count == source.count()
    return peak


def test_streamed_parquet_is_read_batch_by_batch(tmp_path, monkeypatch):
    """Memory stays flat as the file grows (measured here: ~4 MB for both 8 MB and 32 MB of text)."""
    import datasets

    def no_datasets(*args, **kwargs):
        raise AssertionError("a streamed local Parquet file must not go through datasets.load_dataset")

    monkeypatch.setattr(datasets, "load_dataset", no_datasets)
    _big_parquet(tmp_path / "small.parquet", 4000)
    nbytes = _big_parquet(tmp_path / "big.parquet", 16000)
    small, big = _peak_arrow_bytes(tmp_path / "small.parquet"), _peak_arrow_bytes(tmp_path / "big.parquet")
    assert big < nbytes / 4, f"Arrow held {big} bytes at once while streaming a {nbytes}-byte table"
    assert big < 1.25 * small + (1 << 20), f"peak grew with the file: {small} -> {big} bytes"


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_streamed_rows_equal_materialised_rows(tmp_path, suffix):
    rows = [{"conversations": [{"from": "human", "value": f"prompt {k}"}], "n": k} for k in range(300)]
    path = tmp_path / f"rows.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    else:
        write_jsonl(path, rows)
    for limit, seed in ((None, 0), (50, 0), (50, 7)):
        plain = [(r.index, r.origin, r.value) for r in Source(str(path)).rows(limit, seed)]
        streamed = [(r.index, r.origin, r.value) for r in Source(str(path), streaming=True).rows(limit, seed)]
        assert plain == streamed and len(plain) == (limit or 300)


def test_streaming_gives_the_same_shards(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"q{k}"}]} for k in range(60)])
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in src.read_text().splitlines()]), tmp_path / "p.parquet")
    out = {}
    for streaming in ("false", "true"):
        run = tmp_path / f"run-{streaming}"
        run_prepare(
            config(run, f'data.source="{tmp_path / "p.parquet"}"', "data.limit=25", f"data.streaming={streaming}")
        )
        out[streaming] = {p.name: p.read_bytes() for p in (run / "prompts").glob("shard-*.parquet")}
    assert out["false"] == out["true"]


# -- mixing -----------------------------------------------------------------------------------------


def test_quotas_follow_the_weights_and_add_up():
    from fractions import Fraction

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
