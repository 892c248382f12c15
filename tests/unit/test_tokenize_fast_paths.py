"""Tokenization's fast paths: plain-Python renderers and masks from token lengths give exactly what
jinja and the tokenizer's offsets give, and a disagreement stops the batch."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
from test_tokenize import make_run, run_stage, server_record  # noqa: E402
from tokenize_cases import CONVERSATIONS, tokenizer_for  # noqa: E402

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
