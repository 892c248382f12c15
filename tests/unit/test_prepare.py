"""Stage prepare on the shipped demo file and on hand-made sources."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.manifest import read_manifest
from eagle3.prepare.sources import SourceError
from eagle3.prepare.stage import MARKER, PrepareError, run_prepare, shard_of

DEMO_BAD_KINDS = {
    "invalid_json",
    "empty",
    "non_string_content",
    "duplicate",
    "unknown_role",
    "not_an_object",
    "too_long",
    "no_user_turn",
    "bad_turn",
    "no_conversation",
    "empty_content",
}


def config_for(run_dir, *sets):
    return load_config(DEMO_RECIPE, [f'run_dir="{run_dir}"', *sets])


def read_shards(out: Path):
    rows = []
    for path in sorted(out.glob("shard-*.parquet")):
        rows += [dict(r, shard=path.name) for r in pq.read_table(path).to_pylist()]
    return rows


def file_bytes(out: Path):
    return {
        p.name: p.read_bytes()
        for p in sorted(out.iterdir())
        if p.name.startswith("shard-") or p.name == "rejected.jsonl"
    }


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_demo_file_accounting_adds_up(tmp_path):
    result = run_prepare(config_for(tmp_path / "run"))
    out = Path(result.out_dir)
    counts = read_manifest(tmp_path / "run")["stages"]["prepare"]
    assert counts["in"] == counts["ok"] + counts["failed"] + counts["filtered"]
    assert counts["source_rows"] == 313 and counts["in"] == 313
    assert counts["ok"] == 302 and counts["filtered"] == 11
    assert set(counts["reasons"]) == DEMO_BAD_KINDS and all(n == 1 for n in counts["reasons"].values())
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == counts["filtered"]
    assert all(r["reason"] and r["origin"].startswith("builtin:demo_prompts:") for r in rejected)
    rows = read_shards(out)
    assert len(rows) == counts["ok"] == sum(counts["shards"])
    assert len({r["id"] for r in rows}) == len(rows)
    accepted = {r["source_index"] for r in rows}
    assert accepted.isdisjoint({r["source_index"] for r in rejected})
    assert len(accepted) + len(rejected) == 313
    for r in rows:
        assert r["messages"][-1]["role"] == "user"
        assert r["shard"] == f"shard-{shard_of(r['id'], 0, 4):05d}.parquet"
    by_shard = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(r["source_index"])
    assert all(v == sorted(v) for v in by_shard.values())


def test_same_input_gives_byte_identical_shards(tmp_path):
    a = run_prepare(config_for(tmp_path / "a"))
    b = run_prepare(config_for(tmp_path / "b"))
    assert file_bytes(Path(a.out_dir)) == file_bytes(Path(b.out_dir))
    c = run_prepare(config_for(tmp_path / "c", "data.seed=1"))
    assert file_bytes(Path(a.out_dir)) != file_bytes(Path(c.out_dir))


def test_rerun_does_nothing_and_deleted_shard_is_rebuilt(tmp_path):
    config = config_for(tmp_path / "run")
    first = run_prepare(config)
    out = Path(first.out_dir)
    before = file_bytes(out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    again = run_prepare(config)
    assert again.skipped and not first.skipped
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == mtimes

    (out / "shard-00002.parquet").unlink()
    rebuilt = run_prepare(config)
    assert not rebuilt.skipped
    assert file_bytes(out) == before
    for name, mtime in mtimes.items():
        if name != "shard-00002.parquet":
            assert (out / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"


def test_corrupted_shard_is_detected_and_rebuilt(tmp_path):
    config = config_for(tmp_path / "run")
    out = Path(run_prepare(config).out_dir)
    before = file_bytes(out)
    (out / "shard-00001.parquet").write_bytes(b"PAR1 torn")
    assert not run_prepare(config).skipped
    assert file_bytes(out) == before


def test_fewer_shards_removes_stale_ones(tmp_path):
    run_prepare(config_for(tmp_path / "run"))
    result = run_prepare(config_for(tmp_path / "run", "data.num_shards=2"))
    out = Path(result.out_dir)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.parquet", "shard-00001.parquet"]
    assert len(read_shards(out)) == 302


def test_limit_is_a_seeded_sample(tmp_path):
    def sample(name, seed):
        result = run_prepare(config_for(tmp_path / name, "data.limit=40", f"data.seed={seed}"))
        return result.counts["source_rows"], sorted(r["source_index"] for r in read_shards(Path(result.out_dir)))

    n1, a = sample("a", 1)
    n2, b = sample("b", 1)
    _, c = sample("c", 2)
    assert n1 == n2 == 40
    assert a == b and a != c
    assert max(a) > 100  # a sample across the file, not its first rows


def test_too_many_rejections_fail_loudly_without_marker(tmp_path):
    src = write_jsonl(
        tmp_path / "bad.jsonl", [{"text": "x"}, {"text": "y"}, {"conversations": [{"from": "human", "value": "ok"}]}]
    )
    config = config_for(tmp_path / "run", f'data.source="{src}"')
    with pytest.raises(PrepareError) as err:
        run_prepare(config)
    msg = str(err.value)
    assert "2 of 3 candidate prompts were rejected" in msg and "no_conversation=2" in msg and "rejected.jsonl" in msg
    out = tmp_path / "run" / "prompts"
    assert not (out / MARKER).exists()
    assert len((out / "rejected.jsonl").read_text().splitlines()) == 2
    assert read_manifest(tmp_path / "run")["stages"]["prepare"]["status"] == "failed"


def test_openai_schema_folder_with_json_jsonl_and_parquet(tmp_path):
    import pyarrow as pa

    folder = tmp_path / "src"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"messages": [{"role": "user", "content": "alpha"}]}, "{oops"])
    (folder / "b.json").write_text(
        json.dumps(
            {"data": [{"messages": [{"role": "user", "content": "beta"}, {"role": "assistant", "content": "B"}]}]}
        )
    )
    table = pa.Table.from_pylist(
        [
            {"conversations": [{"from": "human", "value": "gamma"}]},
            {"conversations": [{"from": "human", "value": "alpha"}]},
        ]
    )
    pq.write_table(table, folder / "c.parquet")
    (folder / "notes.txt").write_text("ignored: not a data file")
    result = run_prepare(config_for(tmp_path / "run", f'data.source="{folder}"', "data.num_shards=1"))
    rows = read_shards(Path(result.out_dir))
    assert [r["messages"][0]["content"] for r in rows] == ["alpha", "beta", "gamma"]
    assert [r["source_index"] for r in rows] == [0, 2, 3]
    rejected = [json.loads(x) for x in (Path(result.out_dir) / "rejected.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["source_index"]) for r in rejected] == [("invalid_json", 1), ("duplicate", 4)]
    assert rejected[0]["origin"] == f"{folder / 'a.jsonl'}:2"
    assert rejected[1]["origin"] == f"{folder / 'c.parquet'}#row1"


def test_all_turns_mode_accounts_per_prompt(tmp_path):
    src = write_jsonl(
        tmp_path / "mt.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "q1"},
                    {"from": "gpt", "value": "a1"},
                    {"from": "human", "value": "q2"},
                ]
            },
            {"conversations": [{"from": "human", "value": "q1"}]},
        ],
    )
    result = run_prepare(config_for(tmp_path / "run", f'data.source="{src}"', 'data.turns="all_turns"'))
    c = result.counts
    assert (c["in"], c["ok"], c["filtered"], c["source_rows"]) == (3, 2, 1, 2)
    assert c["reasons"] == {"duplicate": 1}


def test_new_rows_do_not_move_existing_prompts(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}]} for i in range(60)]
    small = run_prepare(config_for(tmp_path / "a", f'data.source="{write_jsonl(tmp_path / "s.jsonl", rows[:40])}"'))
    big = run_prepare(config_for(tmp_path / "b", f'data.source="{write_jsonl(tmp_path / "b.jsonl", rows)}"'))
    where = lambda res: {r["id"]: r["shard"] for r in read_shards(Path(res.out_dir))}  # noqa: E731
    old, new = where(small), where(big)
    assert all(new[i] == s for i, s in old.items())


@pytest.mark.parametrize(
    "source, message",
    [
        ("missing/dir/prompts.jsonl", "no such file or folder"),
        ("./nope", "no such file or folder"),
        ("nobody-owner/no-such-dataset", "could not load from the Hugging Face hub"),
    ],
)
def test_bad_sources_name_themselves(tmp_path, source, message):
    with pytest.raises(SourceError) as err:
        run_prepare(config_for(tmp_path / "run", f'data.source="{source}"'))
    assert source in str(err.value) and message in str(err.value)


def test_unsupported_file_and_bad_json_array(tmp_path):
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type"):
        run_prepare(config_for(tmp_path / "run", f'data.source="{tmp_path / "p.csv"}"'))
    (tmp_path / "p.json").write_text('{"a": 1}')
    with pytest.raises(SourceError, match=r"p\.json: expected a JSON list of rows"):
        run_prepare(config_for(tmp_path / "run", f'data.source="{tmp_path / "p.json"}"'))


KILL_SCRIPT = """
import sys
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.prepare.stage import run_prepare
run_prepare(load_config(DEMO_RECIPE, sys.argv[1:]))
"""


def test_sigkill_mid_stage_then_rerun_matches_clean_run(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "s" * (i % 7 + 1)},
                {"from": "human", "value": f"prompt number {i} " * 20},
            ]
        }
        for i in range(150_000)
    ]
    src = write_jsonl(tmp_path / "big.jsonl", rows)
    sets = [f'data.source="{src}"', "data.num_shards=3"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, f'run_dir="{killed}"', *sets])
    out = killed / "prompts"
    deadline = time.monotonic() + 60
    while not list(out.glob(".shard-*.partial")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed; make the input bigger"
    assert not (out / MARKER).exists()
    assert not (out / "rejected.jsonl").exists() or (out / "rejected.jsonl").read_text() == ""

    resumed = run_prepare(config_for(killed, *sets))
    clean = run_prepare(config_for(tmp_path / "clean", *sets))
    assert file_bytes(Path(resumed.out_dir)) == file_bytes(Path(clean.out_dir))
    assert resumed.counts["ok"] == 150_000
    assert not list(out.glob(".*")), "the rerun must clear the killed run's temporary files"
