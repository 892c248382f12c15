"""Dataset presets, hub arguments (subset, split, streaming) and streamed reading (mixes: test_mix.py).

Nothing is fetched: each preset reads a small file in its dataset's schema (tests/fixtures/presets),
and the hub loader is replaced by one that records its arguments and serves rows from memory.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from source_fixtures import FIXTURES, FakeHub, config, kept, rejected, write_jsonl

from eagle3.config import DEMO_RECIPE, ConfigError, DataConfig, load_config
from eagle3.config.data import PRESET_NAMES
from eagle3.manifest import read_manifest
from eagle3.prepare.presets import PRESETS
from eagle3.prepare.sources import Source, reservoir
from eagle3.prepare.stage import run_prepare

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


def test_the_config_names_every_preset_and_only_them():
    """data.preset accepts exactly the presets defined, in their order (the config lists the names
    itself: it sits below the prepare stage)."""
    assert PRESET_NAMES == tuple(PRESETS)


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
