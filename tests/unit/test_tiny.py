"""The tiny offline model: deterministic build, tokenizer, templates, sampling behaviour, cache.

Three real builds for the whole module (qwen3 via build_tiny, qwen3 via
ensure_tiny, llama), shared through module fixtures; the rest uses them or
cheap fakes of the write step.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.tiny import BUILD_VERSION, behaviour, build, build_tiny, ensure_tiny

QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "Add."},
]


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny(root / arch, arch=arch) for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def cached(cache_dir) -> Path:
    return ensure_tiny("qwen3", cache_dir=cache_dir)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def qwen3_model(built):
    import torch
    from transformers import AutoModelForCausalLM

    # float32 from the bf16 file: same weights, several times faster on CPU.
    model = AutoModelForCausalLM.from_pretrained(built["qwen3"], dtype=torch.float32)
    # Ops this small only lose from intra-op threads, badly so on a busy
    # 2-core machine (measured 10x); restore the setting for other tests.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield model.eval(), load_tokenizer(built["qwen3"])
    torch.set_num_threads(threads)


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# --- build -------------------------------------------------------------------------------


def test_two_builds_are_byte_identical(built, cached):
    a, b = file_bytes(built["qwen3"]), file_bytes(cached)
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= set(a)
    assert a.keys() == b.keys()
    assert [n for n in a if a[n] != b[n]] == []


@pytest.mark.parametrize(
    "arch,cls,eot", [("qwen3", "Qwen3ForCausalLM", "<|im_end|>"), ("llama", "LlamaForCausalLM", "<|eot_id|>")]
)
def test_loads_with_auto_classes(built, arch, cls, eot):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = built[arch]
    cfg = AutoConfig.from_pretrained(path)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == cls and cfg.architectures == [cls]
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert shape == (128, 4, 4, 2, 32)
    assert cfg.max_position_embeddings == 4096 and cfg.tie_word_embeddings is False
    assert cfg.vocab_size % 64 == 0 and len(tok) <= cfg.vocab_size < len(tok) + 64
    assert str(cfg.dtype).endswith("bfloat16")
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(eot)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert json.loads((path / build.MARKER).read_text()) == {"arch": arch, "build_version": BUILD_VERSION}


def test_unknown_arch_names_allowed_values(tmp_path):
    for call in (
        lambda: build_tiny(tmp_path / "m", arch="mistral"),
        lambda: ensure_tiny("mistral", cache_dir=tmp_path),
    ):
        with pytest.raises(ValueError, match="llama, qwen3"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_import_is_cheap():
    code = (
        "import sys, eagle3.tiny; print(sorted(m for m in ('torch', 'transformers', 'tokenizers', 'prefect') if m in "
        "sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert out.stdout.strip() == "[]"


def fake_write(spec, out: Path) -> None:
    (out / "config.json").write_text("{}")
    (out / build.MARKER).write_text(json.dumps({"arch": spec.name}))


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def crash(spec, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "write_model_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        build_tiny(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_build_replaces_only_tiny_or_empty_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "write_model_dir", fake_write)
    out = tmp_path / "model"
    out.mkdir()
    assert build_tiny(out) == out  # empty dir: fine
    (out / "extra").write_text("old build leftovers")
    build_tiny(out)  # earlier tiny build: replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["config.json", build.MARKER]
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny(user_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model"]


# --- ensure_tiny -------------------------------------------------------------------------


def test_ensure_tiny_builds_once(cached, cache_dir, monkeypatch):
    assert cached.parent == cache_dir and cached.name.startswith("tiny-qwen3-")
    mtime = (cached / "model.safetensors").stat().st_mtime_ns

    def no_rebuild(spec, out):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(build, "write_model_dir", no_rebuild)
    assert ensure_tiny("qwen3", cache_dir=cache_dir) == cached
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(cache_dir))
    assert ensure_tiny() == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in cache_dir.iterdir()] == [cached.name]


def test_ensure_tiny_race_loser_uses_winner(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "write_model_dir", fake_write)
    winner = ensure_tiny("llama", cache_dir=tmp_path)
    # The loser checked before the winner finished, then built its own copy.
    real_check, calls = build.is_tiny_build, []

    def stale_first(path):
        calls.append(path)
        return len(calls) > 1 and real_check(path)

    monkeypatch.setattr(build, "is_tiny_build", stale_first)
    assert ensure_tiny("llama", cache_dir=tmp_path) == winner
    assert len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [winner.name]


# --- tokenizer and templates -------------------------------------------------------------


@pytest.mark.parametrize("arch,specials", [("qwen3", QWEN3_SPECIALS), ("llama", LLAMA_SPECIALS)])
def test_special_and_think_tokens(built, arch, specials):
    tok = load_tokenizer(built[arch])
    for t in specials:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == [t] and t in tok.all_special_tokens
    for t in ("<think>", "</think>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1 and t not in tok.all_special_tokens
    ids = tok.encode(
        "<think>\nhmm</think>ok<|im_end|>" if arch == "qwen3" else "<think>\nhmm</think>ok<|eot_id|>",
        add_special_tokens=False,
    )
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhmm</think>ok"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_round_trip_mixed_text(built, arch):
    tok = load_tokenizer(built[arch])
    text = (
        "Solve 3x + 5 = 20, i.e. $x = \\frac{15}{3}$.\n\n```python\ndef f(xs):\n    return [x ** 2 for x in xs]\n```\n"
        "Café, naïve, 東京, emoji 🙂 and tabs\tend. <think>why</think> done"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Common English, code and digits stay compact (not byte soup).
    assert len(tok.encode("The answer to the question is the sum of the values.", add_special_tokens=False)) <= 12


def test_qwen3_template_renders_exactly(built):
    tok = load_tokenizer(built["qwen3"])
    history = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    )
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert full == history + "<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4<|im_end|>\n"
    prompt = tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert prompt == history + "<|im_start|>assistant\n<think>\n"
    no_think = tok.apply_chat_template(
        CONVERSATION[:4], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # Reasoning inline in content is split out like Qwen3 does.
    inline = [CONVERSATION[1], {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"}]
    assert tok.apply_chat_template(inline, tokenize=False).endswith("<think>\nAdd.\n</think>\n\n4<|im_end|>\n")


def test_llama_template_renders_exactly(built):
    tok = load_tokenizer(built["llama"])
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = (
        "<|begin_of_text|>"
        + head.format("system")
        + "You are terse.<|eot_id|>"
        + head.format("user")
        + "Hi<|eot_id|>"
        + head.format("assistant")
        + "Hello!<|eot_id|>"
        + head.format("user")
        + "2+2?<|eot_id|>"
        + head.format("assistant")
        + "4<|eot_id|>"
    )
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == expected
    prompt = tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.rindex("4<|eot_id|>")]


@pytest.mark.parametrize(
    "arch,supervised",
    [("qwen3", "Hello!<|im_end|>Add.\n</think>\n\n4<|im_end|>"), ("llama", "Hello!<|eot_id|>4<|eot_id|>")],
)
def test_assistant_mask_covers_exactly_the_assistant_text(built, arch, supervised):
    tok = load_tokenizer(built[arch])
    out = tok.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == supervised
    # The generation prompt's tokens are a prefix of the full conversation's and
    # everything after them up to the end-of-turn is supervised: server-side
    # token ids and template-side masks line up.
    prompt = tok.apply_chat_template(CONVERSATION[:4], add_generation_prompt=True, return_dict=True)["input_ids"]
    last = max(i for i, m in enumerate(mask) if m)
    assert ids[: len(prompt)] == prompt and all(mask[len(prompt) : last + 1])
    assert tok.convert_ids_to_tokens(ids[last]) == tok.eos_token


# --- sampling behaviour ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_samples_reason_then_answer_then_stop(qwen3_model, temperature):
    model, tok = qwen3_model
    completions, stats = behaviour.measure(
        model, tok, per_prompt=10, prompts=behaviour.PROMPTS[:3], temperature=temperature, top_p=0.95, max_tokens=256
    )
    assert stats.samples == 30
    assert stats.stop_rate >= 0.8, stats
    assert stats.think_rate >= 0.7, stats
    assert 20 <= stats.mean_length <= 200, stats
    never = set(tok.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>", "<think>"]))
    sampled = {t for c in completions for t in c}
    assert not sampled & never and max(sampled) < len(tok)


def test_greedy_does_not_collapse(qwen3_model):
    model, tok = qwen3_model
    prompts = [behaviour.prompt_ids(tok, text) for text in behaviour.PROMPTS[:4]]
    completions = behaviour.sample(model, prompts, 1, 128, 0, 1.0, 0, tok.eos_token_id)
    tokens = [t for c in completions for t in c]
    counts = collections.Counter(tokens)
    assert len(tokens) >= 128
    assert len(counts) >= 8
    assert counts.most_common(1)[0][1] <= 0.5 * len(tokens)
