"""On-policy multi-turn regeneration (data.turns = "regenerate") against the fake server (a test tool
whose answers are a deterministic function of the whole context): turn order, context, durability
under SIGKILL, resume mid-conversation, the partial-conversation policy, accounting, and tokenization."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.generate.conversation import turns_path
from eagle3.generate.shard import generate_shard, paths
from eagle3.prepare.stage import run_prepare
from eagle3.records import read_records
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool
from fake_openai import FakeConfig, FaultRule, run_fake_server
from test_generate_faults import FAST, accounting

REGEN = ["data.turns=regenerate"]


def conversations(n: int, turns: int, tag: str = "") -> list[dict]:
    rows = []
    for i in range(n):
        conv = [{"from": "system", "value": "Be brief."}]
        for t in range(1, turns + 1):
            conv.append({"from": "human", "value": f"conv {i} turn {t}{tag if t == 2 and i == 0 else ''}"})
            conv.append({"from": "gpt", "value": f"DATASET ANSWER {i}.{t}"})
        rows.append({"conversations": conv})
    return rows


def make_run(tmp_path, rows, *sets, name="run"):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f'run_dir="{tmp_path / name}"', f'data.source="{src}"', "data.num_shards=1", *FAST, *REGEN, *sets]
    config = load_config(DEMO_RECIPE, overrides)
    return config, Path(run_prepare(config).out_dir) / "shard-00000.parquet", overrides


def generate(config, shard, base_urls):
    async def go():
        pool = EndpointPool(base_urls, None, config.generation.concurrency, 30)
        try:
            out = Path(config.run_dir) / "generations"
            return await generate_shard(
                shard, out, config.generation, "fake-target", pool, **RunFacts.resolve(config).request_plan
            )
        finally:
            await pool.close()

    return asyncio.run(go())


def streams(config):
    p = paths(Path(config.run_dir) / "generations", "shard-00000.parquet")
    return {k: read_records(p[k]) for k in ("ok", "filtered", "failed", "turns")}


def test_each_turn_is_answered_with_the_targets_own_earlier_answers(tmp_path):
    config, shard, _ = make_run(tmp_path, conversations(3, 3))
    with run_fake_server(FakeConfig()) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
        assert fake.stats()["requests_total"] == 9  # one request per user turn
    assert (result.in_, result.ok, result.failed) == (3, 3, 0)
    s = streams(config)
    assert len(s["turns"]) == 6 and len({r["id"] for r in s["turns"]}) == 6  # turns 1 and 2 of each
    turns = {(r["sample_id"], r["turn"]): r for r in s["turns"]}
    for rec in s["ok"]:
        assert rec["regenerated_turns"] == 3 and "shortened" not in rec
        roles = [m["role"] for m in rec["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        answers = [m for m in rec["messages"] if m["role"] == "assistant"]
        for t, answer in enumerate(answers, start=1):
            written = turns[(rec["id"], t)]
            assert answer["content"] == (written["content"] or "")
            assert answer.get("reasoning_content") == (written["reasoning"] or None)
        assert not any("DATASET ANSWER" in m["content"] for m in rec["messages"])
        assert rec["prompt_token_ids"] and rec["completion_token_ids"]


KILL_SCRIPT = """
import asyncio, sys
from pathlib import Path
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.serving.client import EndpointPool
from eagle3.serving.client import EndpointPool
from eagle3.generate.shard import generate_shard

config = load_config(DEMO_RECIPE, sys.argv[3:])
async def go():
    pool = EndpointPool([sys.argv[2]], None, config.generation.concurrency, 30)
    await generate_shard(sys.argv[1], Path(config.run_dir) / "generations", config.generation, "fake-target", pool,
                         regenerate=True)
asyncio.run(go())
"""


def test_sigkill_mid_conversation_resumes_without_reasking_finished_turns(tmp_path):
    rows = conversations(24, 4)
    sets = ["generation.fsync_every=1000", "generation.concurrency=4"]
    config, shard, overrides = make_run(tmp_path, rows, *sets)
    turns_file = turns_path(paths(Path(config.run_dir) / "generations", shard.name)["ok"])
    with run_fake_server(FakeConfig(slots=4, tokens_per_s=3000, ttft_s=0.02)) as fake:
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(shard), fake.base_url, *overrides])
        deadline = time.monotonic() + 60
        while (not turns_file.exists() or turns_file.read_bytes().count(b"\n") < 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        before = streams(config)
        assert len(before["ok"]) < 24, "the kill must land mid-shard"
        open_convs = {r["sample_id"] for r in before["turns"]} - {r["id"] for r in before["ok"]}
        assert open_convs, "the kill must land mid-conversation"
        sent_before = fake.stats()["requests_total"]
        result = accounting(generate(config, shard, [fake.base_url]))
        sent_after = fake.stats()["requests_total"] - sent_before
    after = streams(config)
    assert result.ok == 24 and len(after["ok"]) == 24 and len({r["id"] for r in after["ok"]}) == 24
    assert len(after["turns"]) == 24 * 3 and len({r["id"] for r in after["turns"]}) == 24 * 3  # no duplicate turn
    # The rerun sent only the turns not on disk (in-flight requests at the kill are the only repeats).
    answered_before = len(before["turns"]) + len(before["ok"])
    assert sent_after <= 24 * 4 - answered_before + 4

    # Same records as a run that was never interrupted (the fake's answer is a function of the context).
    clean, clean_shard, _ = make_run(tmp_path, rows, *sets, name="clean")
    with run_fake_server(FakeConfig()) as fake:
        generate(clean, clean_shard, [fake.base_url])
    keep = ("messages", "content", "reasoning", "prompt_token_ids", "completion_token_ids")
    got = {r["id"]: {k: r[k] for k in keep} for r in after["ok"]}
    want = {r["id"]: {k: r[k] for k in keep} for r in streams(clean)["ok"]}
    assert got == want


def test_permanent_failure_at_a_later_turn_keeps_a_shorter_conversation(tmp_path):
    rule = FaultRule(match="BADTURN", kind="status", status=400, times=None)
    config, shard, _ = make_run(tmp_path, conversations(3, 3, tag=" BADTURN"))
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    assert (result.ok, result.failed, result.filtered) == (3, 0, 0)
    s = streams(config)
    short = [r for r in s["ok"] if "shortened" in r]
    assert len(short) == 1
    rec = short[0]
    assert rec["shortened"] == {"at_turn": 2, "of": 3, "reason": "http_400"}
    assert rec["regenerated_turns"] == 1 and [m["role"] for m in rec["messages"]] == ["system", "user"]
    assert rec["content"] == next(t for t in s["turns"] if t["sample_id"] == rec["id"])["content"]
    done = json.loads(paths(Path(config.run_dir) / "generations", shard.name)["done"].read_text())
    assert done["turns"]["shortened"] == 1 and done["turns"]["shortened_by_reason"] == {"http_400": 1}


def test_permanent_failure_at_a_later_turn_drops_the_conversation_when_configured(tmp_path):
    rule = FaultRule(match="BADTURN", kind="status", status=400, times=None)
    rows = conversations(3, 3, tag=" BADTURN")
    config, shard, _ = make_run(tmp_path, rows, "generation.partial_conversations=drop")
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    assert (result.ok, result.failed, result.errors) == (2, 1, {"http_400": 1})
    failed = streams(config)["failed"]
    assert len(failed) == 1 and failed[0]["turn"] == 2 and failed[0]["turns"] == 3 and not failed[0]["transient"]


def test_transient_failure_leaves_the_conversation_open_and_a_rerun_resumes_at_that_turn(tmp_path):
    rule = FaultRule(match="FLAKY", kind="status", status=503, times=4)  # max_attempts is 4 in FAST
    config, shard, _ = make_run(tmp_path, conversations(2, 3, tag=" FLAKY"))
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        first = accounting(generate(config, shard, [fake.base_url]))
        assert (first.ok, first.failed, first.retryable) == (1, 1, 1)
        assert fake.stats()["attempts"]["conv 0 turn 1"] == 1
        second = accounting(generate(config, shard, [fake.base_url]))
        attempts = fake.stats()["attempts"]
    assert attempts["conv 0 turn 1"] == 1  # turn 1 of the open conversation was not asked again
    assert attempts["conv 0 turn 2 FLAKY"] == 5 and attempts["conv 0 turn 3"] == 1
    assert (second.ok, second.failed) == (2, 0)
    s = streams(config)
    assert len(s["turns"]) == 4 and len({r["id"] for r in s["turns"]}) == 4
    assert all(r["regenerated_turns"] == 3 for r in s["ok"])
