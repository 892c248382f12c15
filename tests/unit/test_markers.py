"""One completion protocol: every marker of a run is written and read by eagle3/markers.py, and
run directories of earlier releases (old marker contents, prompts/_SUCCESS.json) still resume."""

import asyncio
import json
from pathlib import Path

import pytest

from eagle3.layout import RunLayout, marker_path
from eagle3.markers import MarkerError, is_marker_name, read_marker, remove_marker, write_marker
from eagle3.run_facts import RunFacts

# The stage whose markers each folder holds.
STAGE_OF = {
    "prompts": "prepare",
    "self": "self_prompts",
    "generations": "generate",
    "tokenized": "tokenize",
    "vocab": "vocab",
    "hidden_states": "extract",
    "train": "train",
}


def test_a_marker_reads_back_as_written(tmp_path):
    path = marker_path(tmp_path / "tokenized", "shard-00003.parquet")
    assert path.name == "shard-00003.done.json"
    written = write_marker(path, "tokenize", "k1", {"in": 5, "ok": 4, "filtered": 1}, parquet_sha256="ab")
    read = read_marker(path, "tokenize")
    assert read == written
    assert (read.stage, read.unit, read.key, read["parquet_sha256"], read.legacy) == (
        "tokenize",
        "shard-00003",
        "k1",
        "ab",
        False,
    )
    assert read.counts == {"in": 5, "ok": 4, "failed": 0, "filtered": 1} and read.written_at
    whole = write_marker(marker_path(tmp_path / "vocab"), "vocab", "k2", {"in": 3, "ok": 3})
    assert whole.path.name == "done.json" and whole.unit is None
    assert read_marker(tmp_path / "nowhere" / "done.json", "vocab") is None


def test_the_writer_refuses_counts_that_lose_rows_and_fields_that_shadow_the_header(tmp_path):
    path = marker_path(tmp_path, "shard-00000")
    with pytest.raises(MarkerError, match="in=5 but ok \\+ failed \\+ filtered = 4: rows were lost"):
        write_marker(path, "tokenize", "k", {"in": 5, "ok": 4})
    with pytest.raises(ValueError, match=r"marker fields \['stage'\] are reserved"):
        write_marker(path, "tokenize", "k", {"in": 1, "ok": 1}, stage="other")
    assert not path.exists()


def test_the_reader_names_the_file_when_a_marker_cannot_be_trusted(tmp_path):
    path = marker_path(tmp_path, "shard-00000")
    write_marker(path, "generate", "k", {"in": 1, "ok": 1})
    with pytest.raises(MarkerError, match=f"{path}: this is a marker of stage 'generate', but tokenize reads it"):
        read_marker(path, "tokenize")
    path.write_text("{not json")
    with pytest.raises(MarkerError, match=f"{path}: not valid JSON.*delete it to redo tokenize"):
        read_marker(path, "tokenize")
    path.write_text(json.dumps({"marker": 99, "stage": "tokenize", "counts": {}}))
    with pytest.raises(MarkerError, match="marker format 99 is not one this version reads"):
        read_marker(path, "tokenize")


def test_markers_of_earlier_releases_are_read_as_they_are(tmp_path):
    old = {"key": "k", "parquet_sha256": "ab", "tokenizer_sha256": "cd", "result": {"ok": 3}}
    path = tmp_path / "shard-00000.done.json"
    path.write_text(json.dumps(old))
    marker = read_marker(path, "tokenize")
    assert marker.legacy and marker.key == "k" and marker["result"] == {"ok": 3} and marker.fields == old
    success = tmp_path / "prompts" / "_SUCCESS.json"
    success.parent.mkdir()
    success.write_text(json.dumps({"fingerprint": "f", "counts": {"in": 2, "ok": 2}, "shards": []}))
    marker = read_marker(tmp_path / "prompts" / "done.json", "prepare")
    assert marker.legacy and marker.key == "f" and marker.path == success
    write_marker(tmp_path / "prompts" / "done.json", "prepare", "g", {"in": 1, "ok": 1})
    assert not success.exists(), "the earlier name must not outlive the new marker"
    success.write_text("{}")
    remove_marker(tmp_path / "prompts" / "done.json", tmp_path)
    assert not success.exists() and read_marker(tmp_path / "prompts" / "done.json", "prepare") is None


def _old_format(path: Path) -> None:
    """Rewrite a marker as an earlier release wrote it: no header, the whole-stage one as _SUCCESS.json
    (vocab and train wrote none)."""
    if path.parent.name in ("vocab", "train"):
        path.unlink()
        return
    doc = json.loads(path.read_text())
    for name in ("marker", "stage", "unit", "written_at"):
        doc.pop(name)
    if path.name == "done.json":
        doc = {"fingerprint": doc.pop("key"), "counts": doc.pop("manifest_entry"), "shards": doc["shards"]}
        path.unlink()
        path = path.with_name("_SUCCESS.json")
    path.write_text(json.dumps(doc))


def _tiny_run(tmp_path):
    """prepare, generate (against the fake server), tokenize, vocab and extract on a tiny run."""
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.extract.stage import extract_shard, plan, record
    from eagle3.generate.shard import generate_shard
    from eagle3.prepare.stage import run_prepare
    from eagle3.serving.client import EndpointPool
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path
    from eagle3.vocab.stage import run_vocab
    from fake_openai import FakeConfig, run_fake_server

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(12)))
    sets = [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"', "data.num_shards=2", 'extract.dtype="float32"']
    config = load_config(DEMO_RECIPE, [*sets, "generation.max_tokens=24", "vocab.draft_vocab_size=64"])
    layout = RunLayout.of(config)
    names = list(run_prepare(config).shards)
    model, template = RunFacts.resolve(config).expected_target()  # what tokenize checks the records were made with

    async def generate(url):
        pool = EndpointPool([url], None, 4, 30)
        try:
            for name in names:
                shard = layout.prompt_shard(name)
                await generate_shard(shard, layout.generations, config.generation, model, pool, template)
        finally:
            await pool.close()

    with run_fake_server(FakeConfig(model=model)) as srv:
        asyncio.run(generate(srv.base_url))
    path = tokenizer_path(config)
    tok = load_tokenizer(path)
    for name in names:
        tokenize_shard(RunFacts.resolve(config), name, tok)
    run_vocab(RunFacts.resolve(config), names)
    the_plan = plan(RunFacts.resolve(config), names)
    record(config, [extract_shard(config, s, the_plan) for s in names], the_plan)
    return config, names


def test_every_marker_of_a_run_is_read_by_the_protocol_and_an_old_run_resumes(tmp_path):
    from eagle3.extract.stage import extract_shard, plan
    from eagle3.prepare.stage import run_prepare
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path

    config, names = _tiny_run(tmp_path)
    run = Path(config.run_dir)
    found = sorted(p for p in run.rglob("*") if is_marker_name(p.name) and not p.name.startswith("."))
    assert {p.parent.name for p in found} == {"prompts", "generations", "tokenized", "vocab", "hidden_states"}
    assert len(found) == 1 + 2 + 2 + 1 + 2, found
    for path in found:
        marker = read_marker(path, STAGE_OF[path.parent.name])
        assert not marker.legacy and marker.stage == STAGE_OF[path.parent.name] and marker.key
        assert marker.unit == (None if path.name == "done.json" else path.name.removesuffix(".done.json"))
        counts = marker.counts
        assert counts["in"] == counts["ok"] + counts["failed"] + counts["filtered"], path

    # The same run as an earlier release left it: every stage resumes without redoing work.
    for path in found:
        _old_format(path)
    assert (run / "prompts" / "_SUCCESS.json").exists() and not (run / "prompts" / "done.json").exists()
    assert run_prepare(config).skipped
    path = tokenizer_path(config)
    tok = load_tokenizer(path)
    assert all(tokenize_shard(RunFacts.resolve(config), name, tok).skipped for name in names)
    the_plan = plan(RunFacts.resolve(config), names)
    assert all(the_plan.done.values()) and all(extract_shard(config, s, the_plan).skipped for s in names)
