"""Self-written prompts (data.source = "self:prompts"): the user-turn prefix from each chat template,
the filters and their accounting, resume after a kill, and stable ids -- against the fake server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from eagle3.config import DEMO_RECIPE, ConfigError, load_config
from eagle3.prepare import self_prompts as sp_mod
from eagle3.prepare.dedup import NearDuplicates, band_rows
from eagle3.prepare.self_prompts import SelfPromptsError, collect, make_plan
from eagle3.prepare.turn_prefix import derive, derive_all
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool
from fake_openai import FakeConfig, FaultRule, run_fake_server, vocabulary

# A SmolLM2-style ChatML template: without a system message it writes a default one.
CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REJECTS_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif "
    "%}<u>{{ m['content'] }}</u>\n{% endfor %}"
)

SCRIPT = [
    "Write a poem about cats.",
    "write a  POEM about cats.",  # duplicate after normalising
    "",  # empty
    "Hi",  # too short
    "How do I reverse a list in Python?",
    "How can I reverse a list in Python?",  # near duplicate (0.65)
    "word " * 200,  # runs to max_tokens
    "Explain how a TCP handshake works.",
    "What is the capital of France?",
    "Plan a three-day trip to Kyoto for me.",
    "Why is the sky blue during the day?",
]


def tokenizer(arch: str, template: str | None = None):
    from transformers import AutoTokenizer

    from eagle3.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(ensure_tiny(arch))
    if template is not None:
        tok.chat_template = template
    return tok


def config(tmp_path: Path, *sets: str):
    base = [
        f'run_dir="{tmp_path / "run"}"',
        'data.source="self:prompts"',
        "data.self_prompts.n=3",
        "data.self_prompts.max_tokens=40",
        "data.num_shards=2",
        "generation.backoff_base_s=0.01",
        "generation.backoff_max_s=0.05",
    ]
    return load_config(DEMO_RECIPE, [*base, *sets])


async def _collect(cfg, url, plan=None):
    plan = plan or make_plan(RunFacts.resolve(cfg))
    pool = EndpointPool([url], None, cfg.data.self_prompts.concurrency, 10.0)
    try:
        return await collect(cfg, plan, pool, "fake-target")
    finally:
        await pool.close()


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# -- where a user turn starts and ends ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefix_plus_text_plus_stop_is_what_the_template_renders(arch):
    tok = tokenizer(arch)
    for system in (None, "You answer in French."):
        turn = derive(tok, system, f"tiny:{arch}")
        rendered = tok.apply_chat_template(turn.messages("How are you today?"), tokenize=False)
        assert rendered.startswith(turn.prefix + "How are you today?" + turn.stop)
        assert (system or "") in turn.prefix and turn.prefix.rstrip().endswith(("user", "<|end_header_id|>"))
        assert turn.stop_token_ids == (tok.convert_tokens_to_ids(turn.stop),)


def test_known_templates_give_their_turn_markers():
    qwen = derive(tokenizer("qwen3"), None, "tiny:qwen3")
    assert (qwen.prefix, qwen.stop) == ("<|im_start|>user\n", "<|im_end|>")
    llama = derive(tokenizer("llama"), None, "tiny:llama")
    assert (llama.prefix, llama.stop) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")


def test_template_default_system_prompt_is_in_the_prefix_unless_one_is_given():
    tok = tokenizer("qwen3", CHATML_DEFAULT_SYSTEM)
    default, given = derive_all(tok, ["", "Be terse."], "chatml-model")
    assert (
        default.prefix == "<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n<|im_start|>user\n"
    )
    assert default.messages("Q?") == [
        {"role": "user", "content": "Q?"}
    ]  # the template adds its default again when served
    assert given.prefix == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"
    assert given.messages("Q?")[0] == {"role": "system", "content": "Be terse."}
    assert default.stop == given.stop == "<|im_end|>"


def test_templates_that_cannot_be_cut_are_config_errors_naming_the_model():
    with pytest.raises(ConfigError, match="gemma-like.*System role not supported"):
        derive(tokenizer("qwen3", REJECTS_SYSTEM), "a system prompt", "gemma-like")
    assert derive(tokenizer("qwen3", REJECTS_SYSTEM), None, "gemma-like").stop == "</u>"
    with pytest.raises(ConfigError, match="drops-content does not write the user message"):
        derive(
            tokenizer("qwen3", "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% endfor %}"),
            None,
            "drops-content",
        )
    with pytest.raises(ConfigError, match="open-ended writes nothing that ends a user turn"):
        derive(tokenizer("qwen3", "{% for m in messages %}{{ m['content'] }}{% endfor %}"), None, "open-ended")


# -- de-duplication ----------------------------------------------------------------------------------


def test_near_duplicates_are_caught_and_different_requests_kept():
    kept = NearDuplicates(0.6)
    texts = [
        "How do I reverse a list in Python?",
        "How can I reverse a list in Python?",
        "HOW DO I reverse a list   in python?",
        "How do I sort a list in Python?",
        "Tell me a joke about penguins.",
    ]
    verdicts = []
    for k, text in enumerate(texts):
        match, token = kept.check(text)
        verdicts.append(match.kind if match else "kept")
        if match is None:
            kept.add(k, token)
    assert verdicts == ["kept", "near_duplicate", "duplicate", "kept", "kept"]
    # the band width keeps a pair at the threshold findable: 0.6 -> 3 rows; a strict 0.9 -> wider bands
    assert band_rows(0.6) == 3 and band_rows(0.9) > band_rows(0.6)


# -- collection against the fake server -------------------------------------------------------------


def test_filters_count_every_sample_with_a_reason(tmp_path):
    cfg = config(tmp_path, "data.self_prompts.count=6")
    with run_fake_server(FakeConfig(completion_script=SCRIPT)) as srv:
        entry = asyncio.run(_collect(cfg, srv.base_url))
    folder = tmp_path / "run" / "prompts" / "self"
    kept, rejected = lines(folder / "prompts.jsonl"), lines(folder / "rejected.jsonl")
    assert entry["in"] == entry["ok"] + entry["filtered"] + entry["failed"] and entry["failed"] == 0
    assert entry["ok"] == len(kept) == 6 and entry["filtered"] == len(rejected)
    # request i, choice k answers SCRIPT[(3 i + k) % 11]: the first 4 requests hold one of each reason
    assert {r["kind"] for r in rejected} >= {"duplicate", "empty", "too_short", "near_duplicate", "too_long"}
    assert [m["messages"][0]["content"] for m in kept][:3] == [SCRIPT[0], SCRIPT[4], SCRIPT[7]]
    assert all(
        r["kind"] == "surplus"
        for r in rejected
        if (r["request"], r["choice"]) > (kept[-1]["request"], kept[-1]["choice"])
    )
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["self_prompts"]
    assert manifest["reasons"] == {k: sum(1 for r in rejected if r["kind"] == k) for k in manifest["reasons"]}


def test_result_does_not_depend_on_concurrency_and_ids_are_stable(tmp_path):
    from eagle3.prepare.stage import run_prepare

    outputs = []
    with run_fake_server(FakeConfig(completion_script=SCRIPT, tokens_per_s=2000)) as srv:
        for k, concurrency in enumerate((1, 16)):
            cfg = config(tmp_path / str(k), "data.self_prompts.count=7", f"data.self_prompts.concurrency={concurrency}")
            asyncio.run(_collect(cfg, srv.base_url))
            run_prepare(cfg)
            outputs.append(cfg)
    a, b = (Path(c.run_dir) / "prompts" for c in outputs)
    assert (a / "self" / "prompts.jsonl").read_bytes() == (b / "self" / "prompts.jsonl").read_bytes()
    for shard in ("shard-00000.parquet", "shard-00001.parquet"):
        assert (a / shard).read_bytes() == (b / shard).read_bytes()
    import pyarrow.parquet as pq

    ids = [i for s in sorted(a.glob("shard-*.parquet")) for i in pq.read_table(s)["id"].to_pylist()]
    from eagle3.prepare.normalize import prompt_id

    texts = [r["messages"][0]["content"] for r in lines(a / "self" / "prompts.jsonl")]
    assert sorted(ids) == sorted(prompt_id((("user", t),)) for t in texts)  # a content hash, like every source


def test_system_prompts_cycle_and_are_kept_with_the_request(tmp_path):
    cfg = config(tmp_path, "data.self_prompts.count=6", 'data.self_prompts.system_prompts=["", "You are a chef."]')
    script = [f"Request number {k} about something different." for k in range(40)]
    with run_fake_server(FakeConfig(completion_script=script)) as srv:
        asyncio.run(_collect(cfg, srv.base_url))
        prompts_seen = srv.stats()["attempts"]
    kept = lines(tmp_path / "run" / "prompts" / "self" / "prompts.jsonl")
    for row in kept:
        has_system = row["request"] % 2 == 1
        assert (row["messages"][0] == {"role": "system", "content": "You are a chef."}) == has_system
    assert any("You are a chef." in key for key in prompts_seen) and any(
        key.startswith("<|im_start|>user") for key in prompts_seen
    )


def test_failed_requests_count_as_failed_and_past_the_threshold_stop_the_source(tmp_path):
    rule = FaultRule("You are broken.", "status", times=None, status=400)
    script = [f"Request number {k} about something different." for k in range(40)]
    sets = ("data.self_prompts.count=6", 'data.self_prompts.system_prompts=["", "You are broken."]')
    with run_fake_server(FakeConfig(completion_script=script, rules=[rule])) as srv:
        with pytest.raises(SelfPromptsError, match="failed.*max_failure_fraction"):
            asyncio.run(_collect(config(tmp_path / "a", *sets), srv.base_url))
        entry = asyncio.run(
            _collect(config(tmp_path / "b", *sets, "generation.max_failure_fraction=1.0"), srv.base_url)
        )
    assert entry["failed"] > 0 and entry["in"] == entry["ok"] + entry["filtered"] + entry["failed"]
    rejected = lines(tmp_path / "b" / "run" / "prompts" / "self" / "rejected.jsonl")
    failed = [r for r in rejected if r["kind"] == "request_failed"]
    assert len(failed) == entry["failed"] and all(r["request"] % 2 == 1 and "http_400" in r["reason"] for r in failed)
    assert not (tmp_path / "a" / "run" / "prompts" / "self" / "done.json").exists()


def test_transient_errors_are_retried_with_the_generation_policy(tmp_path):
    rule = FaultRule("<|im_start|>user", "status", times=1, status=503)  # every request's first attempt
    cfg = config(tmp_path, "data.self_prompts.count=5")
    with run_fake_server(FakeConfig(completion_script=SCRIPT, rules=[rule])) as srv:
        entry = asyncio.run(_collect(cfg, srv.base_url))
        seeds = srv.stats()["completion_seeds"]
    assert entry["failed"] == 0 and entry["ok"] == 5
    raw = lines(
        tmp_path
        / "run"
        / "prompts"
        / "self"
        / next(p.name for p in (tmp_path / "run" / "prompts" / "self").glob("requests-*"))
    )
    assert all(r["attempts"] == 2 for r in raw) and all(seeds[str(r["seed"])] == 2 for r in raw)


def test_few_survivors_stop_at_max_requests(tmp_path):
    cfg = config(tmp_path, "data.self_prompts.count=50", "data.self_prompts.max_requests=4")
    with run_fake_server(FakeConfig(completion_script=["The same request, over and over again."])) as srv:
        entry = asyncio.run(_collect(cfg, srv.base_url))
        asked = srv.stats()["completion_seeds"]
    assert entry["ok"] == 1 and entry["reasons"] == {"duplicate": 11} and sorted(map(int, asked)) == [0, 3, 6, 9]


# -- resume ----------------------------------------------------------------------------------------

CHILD = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from test_self_prompts import config, _collect
from pathlib import Path
asyncio.run(_collect(config(Path({tmp!r}), *{sets!r}), {url!r}))
"""


def test_a_killed_run_resumes_without_duplicates_or_asking_again(tmp_path):
    rng = random.Random(0)
    words = [w.strip() for w in vocabulary()[16:]]
    script = [" ".join(rng.choice(words) for _ in range(8)) + "?" for _ in range(500)]  # distinct requests
    sets = ("data.self_prompts.count=150", "data.self_prompts.concurrency=4", "generation.fsync_every=1")
    fake = FakeConfig(completion_script=script, tokens_per_s=400)
    folder = tmp_path / "killed" / "run" / "prompts" / "self"
    with run_fake_server(fake, in_thread=False) as srv:
        code = CHILD.format(
            tests=str(ROOT / "tests" / "unit"), tmp=str(tmp_path / "killed"), sets=sets, url=srv.base_url
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while sum(len(lines(p)) for p in folder.glob("requests-*.jsonl")) < 10:
            assert child.poll() is None and time.monotonic() < deadline, "the child ended before it could be killed"
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
        raw = next(folder.glob("requests-*.jsonl"))
        answered = {r["request"]: r["seed"] for r in lines(raw)}
        with open(raw, "ab") as fh:
            fh.write(b'{"request": 999, "torn')  # a write cut by the kill
        assert not (folder / "prompts.jsonl").exists()
        srv.reset_stats()
        resumed = asyncio.run(_collect(config(tmp_path / "killed", *sets), srv.base_url))
        asked_again = {int(s) for s in srv.stats()["completion_seeds"]}
        srv.reset_stats()
        whole = asyncio.run(_collect(config(tmp_path / "whole", *sets), srv.base_url))
    assert not asked_again & set(answered.values()), "a request answered before the kill was asked again"
    indices = [r["request"] for r in lines(raw)]
    assert len(indices) == len(set(indices)), "a request is on disk twice"
    assert (folder / "prompts.jsonl").read_bytes() == (
        tmp_path / "whole" / "run" / "prompts" / "self" / "prompts.jsonl"
    ).read_bytes()
    assert resumed["ok"] == whole["ok"] == 150
    assert asked_again and len(answered) < resumed["requests_judged"], (
        "the kill came after the work was done: nothing resumed"
    )


def test_changed_sampling_settings_start_a_new_request_file(tmp_path):
    with run_fake_server(FakeConfig(completion_script=SCRIPT)) as srv:
        asyncio.run(_collect(config(tmp_path, "data.self_prompts.count=4"), srv.base_url))
        asyncio.run(
            _collect(config(tmp_path, "data.self_prompts.count=4", "data.self_prompts.temperature=0.7"), srv.base_url)
        )
        srv.reset_stats()
        asyncio.run(
            _collect(config(tmp_path, "data.self_prompts.count=6"), srv.base_url)
        )  # more prompts: reuses the first file
        asked = {int(s) for s in srv.stats()["completion_seeds"]}
    files = sorted((tmp_path / "run" / "prompts" / "self").glob("requests-*.jsonl"))
    assert len(files) == 2
    assert 0 not in asked, "request 0 was answered already with these settings"


def test_marker_holds_across_concurrency_but_not_count(tmp_path):
    with run_fake_server(FakeConfig(completion_script=SCRIPT)) as srv:
        cfg = config(tmp_path, "data.self_prompts.count=4")
        asyncio.run(_collect(cfg, srv.base_url))
    plan = make_plan(RunFacts.resolve(cfg))
    assert sp_mod.marker_current(cfg, plan) is not None
    assert (
        sp_mod.marker_current(config(tmp_path, "data.self_prompts.count=4", "data.self_prompts.concurrency=3"), plan)
        is not None
    )
    assert sp_mod.marker_current(config(tmp_path, "data.self_prompts.count=5"), plan) is None
    sp_mod.prompts_file(cfg.run_dir).write_text("{}\n")  # edited by hand: no longer what the marker vouches for
    assert sp_mod.marker_current(cfg, plan) is None


def test_prepare_refuses_self_source_before_the_prompts_are_written(tmp_path):
    from eagle3.prepare.stage import PrepareError, run_prepare

    with pytest.raises(PrepareError, match="self:prompts.*prepare flow"):
        run_prepare(config(tmp_path))


def test_requests_carry_the_turn_stop_and_distinct_seeds(tmp_path):
    cfg = config(tmp_path, "data.self_prompts.seed=100")
    plan = make_plan(RunFacts.resolve(cfg))
    bodies = [sp_mod.request_body(plan, cfg.data.self_prompts, i, "m") for i in range(3)]
    assert [b["seed"] for b in bodies] == [100, 103, 106]  # vLLM seeds the n=3 samples seed..seed+2
    assert all(b["stop"] == ["<|im_end|>"] and b["stop_token_ids"] and b["add_special_tokens"] is False for b in bodies)


def test_unseeded_requests_send_no_seed_and_get_their_own_request_file(tmp_path):
    seeded, unseeded = config(tmp_path), config(tmp_path, "data.self_prompts.seeded=false")
    plan, unseeded_plan = make_plan(RunFacts.resolve(seeded)), make_plan(RunFacts.resolve(unseeded))
    assert "seed" not in sp_mod.request_body(unseeded_plan, unseeded.data.self_prompts, 2, "m")
    assert sp_mod.request_seed(unseeded.data.self_prompts, 2) is None
    assert plan.key != unseeded_plan.key  # answers drawn another way are never mixed


def test_user_starts_open_the_turn_and_only_what_the_target_wrote_is_filtered(tmp_path):
    opening = "Summarize this paragraph:\n\n"
    cfg = config(tmp_path, "data.self_prompts.count=6", f"data.self_prompts.user_starts={json.dumps(['', opening])}")
    plan = make_plan(RunFacts.resolve(cfg))
    bodies = [sp_mod.request_body(plan, cfg.data.self_prompts, i, "m") for i in range(4)]
    assert [b["prompt"].endswith(opening) for b in bodies] == [False, True, False, True]
    assert bodies[1]["prompt"] == bodies[0]["prompt"] + opening  # the opening continues the same user turn
    # a written text that repeats another's is a duplicate even though only one carries the opening
    topics = ["a lighthouse keeper", "bread baking", "tax forms", "orbital decay", "jazz chords", "tide pools"]
    topics += ["sorting networks", "garden snails", "a train timetable", "volcanic glass", "chess openings"]
    script = ["The river rose all night and the town woke to water in the streets."] * 2 + [
        f"Everything I know about {t}, written up as notes for {k + 2} friends." for k, t in enumerate(topics)
    ]
    with run_fake_server(FakeConfig(completion_script=script)) as srv:
        entry = asyncio.run(_collect(cfg, srv.base_url))
    folder = tmp_path / "run" / "prompts" / "self"
    kept, rejected = lines(folder / "prompts.jsonl"), lines(folder / "rejected.jsonl")
    assert entry["in"] == entry["ok"] + entry["filtered"] + entry["failed"] and len(kept) == 6
    assert any(r["kind"] == "duplicate" for r in rejected)
    for row in kept:
        text = row["messages"][0]["content"]
        assert text.startswith(opening.strip()) == (row["request"] % 2 == 1), text
        assert "Summarize" not in text[len(opening) :]
    raw = lines(next(folder.glob("requests-*.jsonl")))
    assert {r["request"] % 2 for r in raw if r["start"] == 1} == {1}


def test_user_starts_off_keeps_every_old_hash_and_on_changes_them(tmp_path):
    from eagle3.config import PipelineConfig, section_hash

    base = PipelineConfig()
    # the hashes before data.self_prompts.user_starts existed (main at 2883b3b)
    assert (base.data.config_hash(), section_hash(base.data.self_prompts)) == ("b08836f2499afdd9", "1b4083d0f9a8022a")
    assert sp_mod._filters_hash(base.data.self_prompts) == "ba87b3a06faddda4"
    off = config(tmp_path, "data.self_prompts.n=3")
    assert make_plan(RunFacts.resolve(off)).key == "916e21154fcb1318"
    on = config(tmp_path, 'data.self_prompts.user_starts=["Fix this function:\\n\\n"]')
    assert make_plan(RunFacts.resolve(on)).key != make_plan(RunFacts.resolve(off)).key  # never mixed in one file
    assert on.data.config_hash() != off.data.config_hash()
    assert section_hash(on.data.self_prompts) != section_hash(off.data.self_prompts)
    assert sp_mod._filters_hash(on.data.self_prompts) != sp_mod._filters_hash(off.data.self_prompts)
