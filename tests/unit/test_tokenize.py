"""Tokenization: golden ids and masks per template, the stage's paths, lengths, bad records, resume."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
from eagle3.config import DEMO_RECIPE, load_config  # noqa: E402
from eagle3.generate.records import JsonlAppender  # noqa: E402
from eagle3.prepare.stage import run_prepare  # noqa: E402
from eagle3.tokenize.build import from_template, render_ids  # noqa: E402
from eagle3.tokenize.stage import (  # noqa: E402
    TokenizeInputError,
    load_tokenizer,
    record,
    tokenize_shard,
    tokenizer_path,
)
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
    path = tokenizer_path(config)
    return tokenize_shard(config, "shard-00000.parquet", tok, path)


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
    entry = record(config, [result], tokenizer_path(config))
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


# ----------------------------------------------------------------------------- plain-Python renderers


def random_conversations(seed: int, n: int, ascii_only: bool = False) -> list[list[dict]]:
    """Varied conversations in the shape the stage renders: edge whitespace, think tags inside
    content, no user turn, assistant turns before the last user turn, empty and unicode text."""
    import random

    rng = random.Random(seed)
    bits = [
        "word",
        " ",
        "\n",
        "\n\n",
        "\t",
        "\u00a0",
        "\u2003",
        "</think>",
        "<think>",
        "é",
        "🙂",
        "<|im_end|>",
        "  x  ",
        "2+2",
        "",
    ]
    if ascii_only:
        bits = [b for b in bits if b.isascii()] + [
            " it's",
            "don't",
            "  \n ",
            "123456",
            "a.b,c!",
            "<|im_start|>",
            "<|eot_id|>",
        ]

    def text():
        return "".join(rng.choice(bits) for _ in range(rng.randint(0, 8)))

    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(0, 4)):
            role = rng.choice(["user", "assistant", "user"])
            turn = {"role": role, "content": text()}
            if role == "assistant" and rng.random() < 0.5:
                turn["reasoning_content"] = text()
            conv.append(turn)
        final = {"role": "assistant", "content": text()}
        if rng.random() < 0.7:
            final["reasoning_content"] = text()
        out.append(conv + [final])
    return out


@pytest.mark.parametrize("template", ["tiny-qwen3", "tiny-llama"])
def test_plain_renderers_equal_jinja_on_varied_conversations(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    from eagle3.tokenize import renderers

    tok = tokenizer_for(template)
    render = renderers.renderer_for(tok.chat_template)
    assert render is not None, (
        "the shipped template has a renderer: an edited template needs its renderer (and hash) reviewed"
    )
    convs = random_conversations(7, 600) + list(CONVERSATIONS.values())
    texts, spans = render_jinja_template(
        convs, chat_template=tok.chat_template, return_assistant_tokens_mask=True, **tok.special_tokens_map
    )
    for conv, text, sp in zip(convs, texts, spans):
        assert render(conv, tok.special_tokens_map) == (text, sp), conv


@pytest.mark.parametrize(
    "conv",
    [
        [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}, {"role": "assistant", "content": "y"}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning": "z"}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
        [{"role": "narrator", "content": "x"}],
    ],
)
def test_plain_renderers_leave_other_shapes_to_jinja(conv):
    from eagle3.tokenize import renderers

    for template in ("tiny-qwen3", "tiny-llama"):
        tok = tokenizer_for(template)
        assert renderers.renderer_for(tok.chat_template)(conv, tok.special_tokens_map) is None


@pytest.mark.parametrize("template", ["tiny-qwen3", "tiny-llama"])
def test_batched_path_gives_the_same_ids_and_masks_with_and_without_plain_renderers(template, monkeypatch):
    from eagle3.tokenize import build

    tok = tokenizer_for(template)
    convs = random_conversations(11, 300) + [[{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]]
    fast = build.from_template_batch(tok, convs)
    monkeypatch.setattr(build, "FAST_RENDER", False)
    slow = build.from_template_batch(tok, convs)
    assert len(fast) == len(slow) == len(convs)
    for a, b in zip(fast, slow):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def test_a_renderer_that_drifts_from_its_template_stops_the_batch(monkeypatch):
    from eagle3.tokenize import build, renderers

    tok = tokenizer_for("tiny-qwen3")
    key = next(k for k, f in renderers.RENDERERS.items() if f is renderers.renderer_for(tok.chat_template))
    real = renderers.RENDERERS[key]

    def drifted(messages, specials):
        text, spans = real(messages, specials)
        return text.replace("Answer", "answer"), spans

    monkeypatch.setitem(renderers.RENDERERS, key, drifted)
    with pytest.raises(
        renderers.RenderMismatch, match=r"disagrees with jinja on conversation 0 .*text differs at char \d+: .*'answer"
    ):
        build.from_template_batch(tok, [CONVERSATIONS["single"]] * 3)


# ----------------------------------------------------------------------------- masks from token lengths


@pytest.mark.parametrize("template", ["tiny-qwen3", "tiny-llama"])
def test_masks_from_token_lengths_equal_masks_from_offsets(template, monkeypatch):
    from eagle3.tokenize import build, offset_free

    tok = tokenizer_for(template)
    assert offset_free.byte_lengths(tok.backend_tokenizer) is not None
    convs = random_conversations(3, 400, ascii_only=True) + random_conversations(5, 200)
    used = []
    real = offset_free.masks
    monkeypatch.setattr(offset_free, "masks", lambda *a: used.extend(m is not None for m in real(*a)) or real(*a))
    quick = build.from_template_batch(tok, convs)
    assert sum(used) >= 400, "the ASCII rows took the offset-free path"
    monkeypatch.setattr(build, "OFFSET_FREE", False)
    with_offsets = build.from_template_batch(tok, convs)
    for a, b in zip(quick, with_offsets, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "Lowercase"}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
        {"post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
        "lstrip",
    ],
)
def test_tokenizers_whose_ids_do_not_place_tokens_keep_offsets(change):
    from tokenizers import Tokenizer

    from eagle3.tokenize import offset_free

    spec = json.loads(tokenizer_for("tiny-qwen3").backend_tokenizer.to_str())
    if change == "lstrip":
        spec["added_tokens"][1]["lstrip"] = True
    else:
        spec.update(change)
    assert offset_free.byte_lengths(Tokenizer.from_str(json.dumps(spec))) is None


def test_a_length_mask_that_disagrees_with_offsets_stops_the_batch(monkeypatch):
    import numpy as np

    from eagle3.tokenize import build, offset_free

    tok = tokenizer_for("tiny-qwen3")
    real = offset_free.masks
    monkeypatch.setattr(offset_free, "masks", lambda *a: [np.roll(m, 1) for m in real(*a)])
    with pytest.raises(
        offset_free.MaskMismatch, match=r"conversation 0 of the batch: ids or mask from token lengths differ"
    ):
        build.from_template_batch(tok, [CONVERSATIONS["single"]] * 3)


def test_stage_output_is_byte_identical_with_or_without_the_fast_paths(tmp_path, monkeypatch):
    import hashlib
    import shutil

    from eagle3.tokenize import build, stage

    def no_ids(k, row, tok):
        rec = server_record(k, row, tok)
        del rec["prompt_token_ids"], rec["completion_token_ids"]
        if k == 2:
            rec["content"] += " café ✓"  # a non-ASCII row: encoded with offsets
        return [rec, rec] if k == 3 else [rec]  # and a duplicate, rejected in record order

    prompts = [f"question number {i}? " + "and more words " * (i % 7) for i in range(40)]
    config, tok, _ = make_run(tmp_path, no_ids, "tokenize.max_seq_len=60", prompts=prompts)
    out = Path(config.run_dir) / "tokenized"

    def outputs():
        shutil.rmtree(out, ignore_errors=True)
        result = run_stage(config, tok)
        return result, {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in out.iterdir()
            if not f.name.endswith("done.json")
        }

    monkeypatch.setattr(stage, "CHUNK_CHARS", 64)  # many small chunks, two encoding at once
    monkeypatch.setattr(stage, "ROW_GROUP_TOKENS", 500)  # several row groups written while encoding goes on
    fast = outputs()
    monkeypatch.setattr(stage, "CHUNK_CHARS", 1 << 30)
    monkeypatch.setattr(build, "FAST_RENDER", False)
    monkeypatch.setattr(build, "OFFSET_FREE", False)
    slow = outputs()
    assert fast == slow
    assert (
        fast[0].ok == 40
        and fast[0].reasons == {"duplicate": 1}
        and len(pq.ParquetFile(out / "shard-00000.parquet").metadata.to_dict()["row_groups"]) > 1
    )
