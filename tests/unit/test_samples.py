"""Several samples per prompt and sampling cycles: stable ids, deterministic assignment, resume by
sample id, per-variant accounting, an unchanged key for runs made before either existed, and the
held-out split keeping a prompt's samples together."""

import hashlib
import json
from pathlib import Path

import pytest

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.generate.samples import prompt_of, sample_id, sampling_for
from eagle3.generate.shard import generation_key, paths
from eagle3.records import read_records
from eagle3.train.split import is_heldout
from fake_openai import FakeConfig, run_fake_server
from test_generate_faults import accounting, generate, make_run


def ok_records(config):
    return read_records(paths(Path(config.run_dir) / "generations", "shard-00000.parquet")["ok"])


def test_samples_have_stable_ids_and_their_own_records(tmp_path):
    prompts = [f"question {i}" for i in range(5)]
    ids = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        config, shard = make_run(tmp_path / name, prompts, "generation.samples_per_prompt=3")
        with run_fake_server(FakeConfig()) as fake:
            result = accounting(generate(config, shard, [fake.base_url]))
            assert fake.stats()["requests_total"] == 15
        assert (result.in_, result.ok) == (15, 15)
        ids.append(sorted(r["id"] for r in ok_records(config)))
    assert ids[0] == ids[1] and len(set(ids[0])) == 15
    by_prompt = {}
    for i in ids[0]:
        by_prompt.setdefault(prompt_of(i), []).append(i)
    assert len(by_prompt) == 5
    for pid, group in by_prompt.items():
        assert sorted(group) == sorted([pid, f"{pid}~s1", f"{pid}~s2"])
    assert all(r.get("prompt_id", r["id"]) == prompt_of(r["id"]) for r in ok_records(config))


def test_raising_samples_per_prompt_keeps_the_samples_on_disk(tmp_path):
    config, shard = make_run(tmp_path, [f"question {i}" for i in range(4)])
    with run_fake_server(FakeConfig()) as fake:
        generate(config, shard, [fake.base_url])
        first = {r["id"]: r["content"] for r in ok_records(config)}
        more = config.model_copy(update={"generation": config.generation.model_copy(update={"samples_per_prompt": 2})})
        result = accounting(generate(more, shard, [fake.base_url]))
        assert fake.stats()["requests_total"] == 8  # 4, then only the 4 new samples
    assert (result.in_, result.ok) == (8, 8)
    after = {r["id"]: r["content"] for r in ok_records(config)}
    assert {k: after[k] for k in first} == first and len(after) == 8


def test_cycles_are_assigned_by_sample_id_and_counted_per_variant(tmp_path):
    sets = ["generation.samples_per_prompt=2", "generation.temperatures=[0.0, 0.7, 1.0]", "generation.top_ps=[0.9]"]
    config, shard = make_run(tmp_path, [f"question {i}" for i in range(12)], *sets)
    with run_fake_server(FakeConfig()) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    gen = config.generation
    temps = {}
    for rec in ok_records(config):
        k = int(rec["id"].split("~s")[1]) if "~s" in rec["id"] else 0
        assert rec["sampling"] == sampling_for(gen, prompt_of(rec["id"]), k)
        temps.setdefault(prompt_of(rec["id"]), set()).add(rec["sampling"]["temperature"])
        assert rec["sampling"]["top_p"] == 0.9
    assert all(len(t) == 2 for t in temps.values()), "a prompt's two samples take different temperatures"
    used = {t for ts in temps.values() for t in ts}
    assert used == {0.0, 0.7, 1.0}
    done = json.loads(paths(Path(config.run_dir) / "generations", shard.name)["done"].read_text())
    assert sum(done["variants"].values()) == result.ok + result.filtered == 24
    assert {json.loads(v)["temperature"] for v in done["variants"]} == used
    # Deterministic: the same sample gets the same settings whatever else is in the run.
    assert sampling_for(gen, "abc", 1) == sampling_for(gen.model_copy(), "abc", 1)


def test_reasoning_cycles_reach_the_request(tmp_path):
    sets = [
        "generation.samples_per_prompt=2",
        "generation.chat_template_kwargs=[{enable_thinking=true}, {enable_thinking=false}]",
        'generation.reasoning_efforts=["low", "high"]',
    ]
    config = load_config(DEMO_RECIPE, sets)
    a, b = (sampling_for(config.generation, "p", k) for k in (0, 1))
    assert {a["chat_template_kwargs"]["enable_thinking"], b["chat_template_kwargs"]["enable_thinking"]} == {True, False}
    assert {a["reasoning_effort"], b["reasoning_effort"]} == {"low", "high"}
    merged = sampling_for(config.generation, "p", 0, extras={"chat_template_kwargs": {"x": 1}})
    assert merged["chat_template_kwargs"]["x"] == 1 and "enable_thinking" in merged["chat_template_kwargs"]


def test_the_key_of_a_run_made_before_samples_and_cycles_is_unchanged():
    gen = load_config(DEMO_RECIPE).generation
    parts = {"model": "m", "max_tokens": gen.max_tokens, "temperature": gen.temperature, "top_p": gen.top_p}
    old = hashlib.sha256(json.dumps({**parts, "template": "t"}, sort_keys=True).encode()).hexdigest()[:16]
    assert generation_key("m", gen, "t") == old
    assert generation_key("m", gen.model_copy(update={"samples_per_prompt": 4}), "t") == old
    assert generation_key("m", gen.model_copy(update={"temperatures": [0.0, 1.0]}), "t") != old
    assert generation_key("m", gen, "t", regenerate=True) != old


def test_a_prompts_samples_fall_on_the_same_side_of_the_held_out_split():
    pids = [hashlib.sha256(str(i).encode()).hexdigest()[:32] for i in range(400)]
    for pid in pids:
        assert is_heldout(sample_id(pid, 1), 0.1) == is_heldout(pid, 0.1) == is_heldout(sample_id(pid, 3), 0.1)
    assert 10 < sum(is_heldout(p, 0.1) for p in pids) < 80


@pytest.mark.parametrize(
    "setting, key",
    [
        ("generation.samples_per_prompt=0", "generation.samples_per_prompt"),
        ("generation.temperatures=[-1.0]", "generation.temperatures"),
        ('generation.reasoning_efforts=["extreme"]', "generation.reasoning_efforts"),
        ("generation.partial_conversations=maybe", "generation.partial_conversations"),
        ("data.turns=every", "data.turns"),
    ],
)
def test_bad_sampling_settings_fail_at_load_naming_the_key(setting, key):
    with pytest.raises(Exception) as err:
        load_config(DEMO_RECIPE, [setting])
    assert key in str(err.value)
