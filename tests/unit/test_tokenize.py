"""Tokenization: golden ids and masks per template, the stage's paths, lengths, bad records, resume."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
from eagle3.config import DEMO_RECIPE, load_config  # noqa: E402
from eagle3.prepare.stage import run_prepare  # noqa: E402
from eagle3.records import JsonlAppender  # noqa: E402
from eagle3.run_facts import RunFacts
from eagle3.tokenize.build import from_template, render_ids  # noqa: E402
from eagle3.tokenize.stage import TokenizeInputError, record, tokenize_shard  # noqa: E402
from eagle3.tokenizer import load_tokenizer, tokenizer_path  # noqa: E402
from tokenize_cases import CONVERSATIONS, TEMPLATES, render_all, tokenizer_for  # noqa: E402

SUPERVISED = {
    "tiny-qwen3/single": ["Two plus two is four.\n</think>\n\n4<|im_end|>"],
    "tiny-qwen3/multi": ["7<|im_end|>", "Two is the only even prime.\n</think>\n\n2<|im_end|>"],
    "tiny-llama/single": ["4<|eot_id|>"],
    "tiny-llama/multi": ["7<|eot_id|>", "2<|eot_id|>"],
    "plain-chatml/single": ["4<|im_end|>\n"],
    "plain-chatml/multi": ["7<|im_end|>\n", "2<|im_end|>\n"],
}


def segments(tok, ids, mask):
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    return out + ([tok.decode(cur)] if cur else [])


def test_goldens_are_current():
    golden = json.loads((ROOT / "tests" / "golden" / "tokenize.json").read_text())
    assert render_all() == golden, "ids changed: if deliberate, run tests/golden/tokenize_cases.py"


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_mask_covers_exactly_the_assistant_text(template, conv):
    tok = tokenizer_for(template)
    sample = from_template(tok, CONVERSATIONS[conv])
    assert len(sample.input_ids) == len(sample.loss_mask)
    assert segments(tok, sample.input_ids, sample.loss_mask) == SUPERVISED[f"{template}/{conv}"]


# ----------------------------------------------------------------------------- the stage


def reply(tok, reasoning, content):
    ids = tok.encode(f"{reasoning}\n</think>\n\n{content}", add_special_tokens=False)
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def make_run(tmp_path, records_for, *sets, prompts=None):
    prompts = prompts or [f"question number {i}?" for i in range(6)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": p}]}) + "\n" for p in prompts))
    config = load_config(
        DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"', "data.num_shards=1", *sets]
    )
    run_prepare(config)
    table = pq.read_table(Path(config.run_dir) / "prompts" / "shard-00000.parquet").to_pylist()
    tok = load_tokenizer(tokenizer_path(config))
    gen = Path(config.run_dir) / "generations"
    gen.mkdir(parents=True, exist_ok=True)
    with JsonlAppender(gen / "shard-00000.jsonl") as out:
        for k, row in enumerate(table):
            for rec in records_for(k, row, tok):
                out.append(rec)
    (gen / "shard-00000.done.json").write_text("{}")
    return config, tok, table


def server_record(k, row, tok, **extra):
    reasoning, content = f"Let me think about item {k}.", f"The answer is {k}."
    return {
        "id": row["id"],
        "prompt_token_ids": render_ids(tok, row["messages"], add_generation_prompt=True),
        "completion_token_ids": reply(tok, reasoning, content),
        "reasoning": reasoning,
        "content": content,
        "finish_reason": "stop",
        **extra,
    }


def read_rows(config):
    return pq.read_table(Path(config.run_dir) / "tokenized" / "shard-00000.parquet").to_pylist()


def run_stage(config, tok):
    return tokenize_shard(RunFacts.resolve(config), "shard-00000.parquet", tok)


def test_server_ids_path_masks_exactly_the_completion(tmp_path):
    config, tok, table = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    result = run_stage(config, tok)
    assert (result.in_, result.ok, result.filtered) == (6, 6, 0)
    records = {
        json.loads(x)["id"]: json.loads(x)
        for x in (Path(config.run_dir) / "generations" / "shard-00000.jsonl").read_text().splitlines()
    }
    for row in read_rows(config):
        rec = records[row["id"]]
        assert row["input_ids"] == rec["prompt_token_ids"] + rec["completion_token_ids"]
        assert row["loss_mask"] == [0] * len(rec["prompt_token_ids"]) + [1] * len(rec["completion_token_ids"])
        assert row["num_supervised"] == len(rec["completion_token_ids"]) and row["path"] == "server_ids"
    assert result.template_check["checked"] == 6 and result.template_check["prompt_mismatch"] == 0
    entry = record(RunFacts.resolve(config), [result])
    assert entry["template_check"]["mismatch_rate"]["prompt_mismatch"] == 0.0


def test_template_mismatch_is_counted_not_fatal(tmp_path):
    def altered(k, row, tok):
        rec = server_record(k, row, tok)
        if k % 2:
            rec["prompt_token_ids"] = rec["prompt_token_ids"][1:]  # not what the template renders
        return [rec]

    config, tok, _ = make_run(tmp_path, altered)
    result = run_stage(config, tok)
    assert result.ok == 6 and result.template_check["prompt_mismatch"] == 3


def test_template_path_for_records_without_ids(tmp_path):
    def no_ids(k, row, tok):
        rec = server_record(k, row, tok)
        del rec["prompt_token_ids"], rec["completion_token_ids"]
        return [rec]

    config, tok, _ = make_run(tmp_path, no_ids)
    result = run_stage(config, tok)
    assert result.ok == 6
    for k, row in enumerate(sorted(read_rows(config), key=lambda r: r["input_ids"])):
        assert row["path"] == "template"
        [supervised] = segments(tok, row["input_ids"], row["loss_mask"])
        assert supervised.startswith("Let me think about item") and supervised.endswith("<|im_end|>")


def test_truncate_and_drop(tmp_path):
    config, tok, table = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)], "tokenize.max_seq_len=20")
    truncated = run_stage(config, tok)
    assert truncated.ok == 6 and truncated.truncated == 6
    assert all(len(r["input_ids"]) == 20 and r["truncated"] and 0 < r["num_supervised"] < 20 for r in read_rows(config))
    dropped = run_stage(
        config.model_copy(update={"tokenize": config.tokenize.model_copy(update={"overflow": "drop"})}), tok
    )
    assert (dropped.ok, dropped.filtered, dropped.reasons) == (0, 6, {"too_long": 6})
    prompt_len = len(render_ids(tok, table[0]["messages"], add_generation_prompt=True))
    short = config.model_copy(update={"tokenize": config.tokenize.model_copy(update={"max_seq_len": prompt_len - 1})})
    assert run_stage(short, tok).reasons == {"no_supervised_tokens": 6}


def test_malformed_records_are_filtered_with_reasons(tmp_path):
    def bad(k, row, tok):
        rec = server_record(k, row, tok)
        if k == 0:
            rec["completion_token_ids"] = "not a list"
        if k == 1:
            rec["id"] = "no-such-id"
        if k == 2:
            rec["completion_token_ids"] = [999_999]
        if k == 3:
            return [rec, dict(rec)]
        if k == 4:
            rec.update(prompt_token_ids=None, completion_token_ids=None, content=None, reasoning=None)
        return [rec]

    config, tok, _ = make_run(tmp_path, bad)
    result = run_stage(config, tok)
    assert result.in_ == 7 and result.in_ == result.ok + result.filtered
    assert result.reasons == {"bad_record": 2, "unknown_id": 1, "duplicate": 1, "empty_completion": 1}
    rejected = [
        json.loads(x)
        for x in (Path(config.run_dir) / "tokenized" / "shard-00000.rejected.jsonl").read_text().splitlines()
    ]
    assert len(rejected) == 5 and all(r["reason"] for r in rejected)
    assert any("outside the tokenizer's vocabulary" in r["reason"] for r in rejected)


def test_rerun_is_skipped_and_settings_change_rebuilds(tmp_path):
    config, tok, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    first = run_stage(config, tok)
    parquet = Path(first.path)
    mtime = parquet.stat().st_mtime_ns
    again = run_stage(config, tok)
    assert again.skipped and not first.skipped and parquet.stat().st_mtime_ns == mtime
    changed = run_stage(
        config.model_copy(update={"tokenize": config.tokenize.model_copy(update={"max_seq_len": 30})}), tok
    )
    assert not changed.skipped and changed.truncated == 6


def test_counts_equal_supervised_tokens(tmp_path):
    from safetensors.numpy import load_file

    config, tok, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    result = run_stage(config, tok)
    counts = load_file(str(Path(config.run_dir) / "tokenized" / "shard-00000.counts.safetensors"))["counts"]
    assert counts.sum() == result.supervised == sum(r["num_supervised"] for r in read_rows(config))
    assert counts[tok.convert_tokens_to_ids("</think>")] == 6


def test_unfinished_generation_shard_is_refused(tmp_path):
    config, tok, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    (Path(config.run_dir) / "generations" / "shard-00000.done.json").unlink()
    with pytest.raises(TokenizeInputError, match="has not finished generating"):
        run_stage(config, tok)


@pytest.mark.parametrize("template", TEMPLATES)
def test_batched_template_path_equals_the_one_by_one_path(template):
    from eagle3.tokenize.build import from_template_batch

    tok = tokenizer_for(template)
    convs = [CONVERSATIONS[name] for name in sorted(CONVERSATIONS)] * 3
    batched = from_template_batch(tok, convs)
    for conv, sample in zip(convs, batched):
        single = from_template(tok, conv)
        assert sample.input_ids.tolist() == single.input_ids.tolist()
        assert sample.loss_mask.tolist() == single.loss_mask.tolist()


def test_a_template_error_is_one_rows_reason():
    from eagle3.tokenize.build import RowError, from_template_batch

    tok = tokenizer_for("tiny-qwen3")
    good = CONVERSATIONS["single"]
    bad = [{"role": "narrator", "content": "x"}]  # the template raises on unknown roles
    out = from_template_batch(tok, [good, bad, good])
    assert [type(x).__name__ for x in out] == ["Sample", "RowError", "Sample"]
    assert isinstance(out[1], RowError) and out[1].kind == "template_error"


def test_a_full_disk_gives_a_clear_error_and_no_complete_looking_shard(tmp_path, monkeypatch):
    import errno

    from eagle3.durable import DiskWriteError

    config, tok, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])

    def full(self, table, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    with pytest.raises(
        DiskWriteError,
        match=r"tokenize: writing .*tokenized/shard-00000.parquet failed: No space left on device; .* GiB free there",
    ):
        run_stage(config, tok)
    out = Path(config.run_dir) / "tokenized"
    assert not (out / "shard-00000.done.json").exists() and not (out / "shard-00000.parquet").exists()
    assert not list(out.glob(".*")), "no partial file is left behind"
    monkeypatch.undo()
    assert run_stage(config, tok).ok == 6, "the rerun completes"


def test_records_from_another_model_are_refused_by_name(tmp_path):
    config, tok, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    gen = Path(config.run_dir) / "generations"
    (gen / "shard-00000.meta.json").write_text(
        json.dumps({"key": "0123456789abcdef", "model": "someone/other-model", "sampling": {"temperature": 1.0}})
    )
    (gen / "shard-00000.done.json").write_text(json.dumps({"key": "0123456789abcdef"}))
    with pytest.raises(
        TokenizeInputError,
        match=(
            r"made by model 'someone/other-model' .* but the config asks for model .*tiny-qwen3.*run `eagle3 "
            r"generate`"
        ),
    ):
        run_stage(config, tok)
    assert not (Path(config.run_dir) / "tokenized" / "shard-00000.done.json").exists()
