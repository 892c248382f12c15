"""Generation against the fault-injecting fake server (a test tool): deadlines, retries,
permanent errors, durability under SIGKILL, torn lines, resume and accounting."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.generate.shard import generate_shard, paths
from eagle3.prepare.stage import run_prepare
from eagle3.records import read_records
from eagle3.serving.client import EndpointPool
from fake_openai import FakeConfig, FaultRule, run_fake_server

FAST = [
    "generation.backoff_base_s=0.05",
    "generation.backoff_max_s=0.2",
    "generation.max_attempts=4",
    "generation.concurrency=8",
]


def make_run(tmp_path, prompts, *sets):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": p}]}) + "\n" for p in prompts))
    config = load_config(
        DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"', "data.num_shards=1", *FAST, *sets]
    )
    shard = Path(run_prepare(config).out_dir) / "shard-00000.parquet"
    return config, shard


def generate(config, shard, base_urls, api_key=None):
    async def go():
        pool = EndpointPool(base_urls, api_key, config.generation.concurrency, 30)
        try:
            return await generate_shard(
                shard, Path(config.run_dir) / "generations", config.generation, "fake-target", pool
            )
        finally:
            await pool.close()

    return asyncio.run(go())


def records(config, kind="ok"):
    return read_records(paths(Path(config.run_dir) / "generations", "shard-00000.parquet")[kind])


def by_prompt(config, kind="ok"):
    import pyarrow.parquet as pq

    table = pq.read_table(Path(config.run_dir) / "prompts" / "shard-00000.parquet").to_pylist()
    text = {r["id"]: r["messages"][-1]["content"] for r in table}
    return {text[r["id"]]: r for r in records(config, kind)}


def accounting(result):
    assert result.in_ == result.ok + result.failed + result.filtered
    return result


def test_hung_request_hits_its_deadline_and_is_retried(tmp_path):
    config, shard = make_run(tmp_path, ["please hang here", "normal one"], "generation.request_timeout_s=1.0")
    with run_fake_server(FakeConfig(rules=[FaultRule(match="hang here", kind="hang", times=1)])) as fake:
        started = time.monotonic()
        result = accounting(generate(config, shard, [fake.base_url]))
        elapsed = time.monotonic() - started
    assert (result.ok, result.failed) == (2, 0)
    hung = by_prompt(config)["please hang here"]
    assert hung["attempts"] == 2 and hung["latency_s"] >= 1.0
    assert 1.0 <= elapsed < 10
    done = json.loads(paths(Path(config.run_dir) / "generations", shard.name)["done"].read_text())
    assert done["retries"] == {"timeout": 1}


def test_429_with_retry_after_is_honoured(tmp_path):
    config, shard = make_run(tmp_path, ["rate limited prompt"])
    with run_fake_server(
        FakeConfig(rules=[FaultRule(match="rate limited", kind="status", status=429, retry_after=1.5, times=1)])
    ) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    record = by_prompt(config)["rate limited prompt"]
    assert result.ok == 1 and record["attempts"] == 2
    assert record["latency_s"] >= 1.5  # backoff_max_s is 0.2: only Retry-After explains the wait


def test_5xx_burst_recovers(tmp_path):
    config, shard = make_run(tmp_path, [f"burst {i}" for i in range(10)])
    with run_fake_server(FakeConfig(rules=[FaultRule(match="burst", kind="status", status=503, times=3)])) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    assert (result.ok, result.failed) == (10, 0)
    assert {r["attempts"] for r in records(config)} == {4}


def test_400_is_recorded_once_and_not_retried(tmp_path):
    config, shard = make_run(tmp_path, ["this one is rejected", "fine"])
    rule = FaultRule(match="is rejected", kind="status", status=400, times=None)
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
        attempts = fake.stats()["attempts"]
    assert (result.ok, result.failed, result.retryable) == (1, 1, 0)
    assert result.complete and result.errors == {"http_400": 1}
    [failed] = records(config, "failed")
    assert failed["error_kind"] == "http_400" and failed["attempts"] == 1 and failed["message"]
    assert attempts["this one is rejected"] == 1


def test_connection_reset_is_retried(tmp_path):
    config, shard = make_run(tmp_path, ["reset me"])
    with run_fake_server(FakeConfig(rules=[FaultRule(match="reset me", kind="reset", times=2)])) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    assert result.ok == 1 and by_prompt(config)["reset me"]["attempts"] == 3


def test_exhausted_transient_failures_leave_the_shard_incomplete_then_resume(tmp_path):
    config, shard = make_run(tmp_path, ["always down", "fine"])
    with run_fake_server(
        FakeConfig(rules=[FaultRule(match="always down", kind="status", status=500, times=5)])
    ) as fake:
        first = accounting(generate(config, shard, [fake.base_url]))
        assert (first.ok, first.failed, first.retryable) == (1, 1, 1) and not first.complete
        second = accounting(generate(config, shard, [fake.base_url]))  # attempts 5.. succeed now
        assert (second.ok, second.failed) == (2, 0) and second.complete
        assert fake.stats()["attempts"]["fine"] == 1, "a finished prompt must not be sent again"
    assert len(records(config)) == 2 and len(records(config, "failed")) == 1  # failure history kept


def test_record_fields_and_truncation_filter(tmp_path):
    config, shard = make_run(
        tmp_path, [f"question {i}" for i in range(40)], "generation.max_tokens=16", "generation.keep_truncated=false"
    )
    with run_fake_server(FakeConfig()) as fake:
        result = accounting(generate(config, shard, [fake.base_url]))
    assert result.filtered > 0 and result.ok > 0 and result.ok + result.filtered == 40
    for r in records(config):
        assert r["finish_reason"] == "stop" and r["prompt_token_ids"] and r["completion_token_ids"]
        assert (
            r["reasoning"] is not None
            and r["content"] is not None
            and r["usage"]["completion_tokens"] == len(r["completion_token_ids"])
        )
        assert r["sampling"] == {"max_tokens": 16, "temperature": 0.6, "top_p": 0.95} and r["model"]
    assert all(
        r["finish_reason"] == "length" and r["reason"].startswith("truncated") for r in records(config, "filtered")
    )


def test_rerun_is_a_no_op_and_new_max_tokens_regenerates(tmp_path):
    config, shard = make_run(tmp_path, [f"q {i}" for i in range(12)])
    with run_fake_server(FakeConfig()) as fake:
        first = generate(config, shard, [fake.base_url])
        fake.reset_stats()
        again = generate(config, shard, [fake.base_url])
        assert again.skipped and fake.stats()["requests_total"] == 0
        bigger = config.model_copy(update={"generation": config.generation.model_copy(update={"max_tokens": 300})})
        regenerated = generate(bigger, shard, [fake.base_url])
        assert fake.stats()["requests_total"] == 12
    assert not first.skipped and not regenerated.skipped and regenerated.ok == 12
    assert {r["sampling"]["max_tokens"] for r in records(config)} == {300}
    stale = list((Path(config.run_dir) / "generations").glob("stale-*/shard-00000.jsonl"))
    assert len(stale) == 1 and len(read_records(stale[0])) == 12


def test_torn_last_line_is_repaired_on_resume(tmp_path):
    config, shard = make_run(tmp_path, [f"q {i}" for i in range(6)])
    with run_fake_server(FakeConfig()) as fake:
        generate(config, shard, [fake.base_url])
        p = paths(Path(config.run_dir) / "generations", shard.name)
        lines = p["ok"].read_bytes().splitlines(keepends=True)
        p["ok"].write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # the last write was cut short
        p["done"].unlink()
        fake.reset_stats()
        result = accounting(generate(config, shard, [fake.base_url]))
        assert fake.stats()["requests_total"] == 1
    ids = [r["id"] for r in records(config)]
    assert result.ok == 6 and len(ids) == len(set(ids)) == 6


KILL_SCRIPT = """
import asyncio, sys
from pathlib import Path
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.serving.client import EndpointPool
from eagle3.generate.shard import generate_shard

config = load_config(DEMO_RECIPE, sys.argv[3:])
async def go():
    pool = EndpointPool([sys.argv[2]], None, config.generation.concurrency, 30)
    await generate_shard(sys.argv[1], Path(config.run_dir) / "generations", config.generation, "fake-target", pool)
asyncio.run(go())
"""


def test_sigkill_mid_shard_then_rerun_gives_exactly_one_record_per_prompt(tmp_path):
    prompts = [f"prompt {i}" for i in range(120)]
    sets = ["generation.fsync_every=1000"]  # kill between fsyncs: flushed lines must still be there
    config, shard = make_run(tmp_path, prompts, *sets)
    ok_file = paths(Path(config.run_dir) / "generations", shard.name)["ok"]
    with run_fake_server(FakeConfig(slots=8, tokens_per_s=2000, ttft_s=0.02)) as fake:
        args = [
            f'run_dir="{config.run_dir}"',
            f'data.source="{tmp_path / "prompts.jsonl"}"',
            "data.num_shards=1",
            *FAST,
            *sets,
        ]
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(shard), fake.base_url, *args])
        deadline = time.monotonic() + 60
        while (not ok_file.exists() or ok_file.read_bytes().count(b"\n") < 30) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        before = len(read_records(ok_file))
        assert 30 <= before < 120, "the kill must land mid-shard"
        result = accounting(generate(config, shard, [fake.base_url]))
    ids = [r["id"] for r in records(config)]
    assert result.ok == 120 and len(ids) == 120 and len(set(ids)) == 120


def test_requests_spread_over_replicas(tmp_path):
    config, shard = make_run(tmp_path, [f"spread {i}" for i in range(40)])
    slow = FakeConfig(slots=4, tokens_per_s=4000)
    with run_fake_server(slow) as a, run_fake_server(slow) as b:
        result = accounting(generate(config, shard, [a.base_url, b.base_url]))
        served = (a.stats()["completed"], b.stats()["completed"])
    assert result.ok == 40 and sum(served) == 40 and min(served) >= 10


def generate_keeping_pool(config, shard, base_urls, outage_wait_s):
    """generate() that hands back the pool too, for its bench counts."""

    async def go():
        pool = EndpointPool(base_urls, None, config.generation.concurrency, 30, outage_wait_s=outage_wait_s)
        try:
            result = await generate_shard(
                shard, Path(config.run_dir) / "generations", config.generation, "fake-target", pool
            )
        finally:
            await pool.close()
        return result, pool

    return asyncio.run(go())


def stop_when(server_cm, server, completed: int, then=None):
    """Exit a running fake server's context (its port then refuses) once it completed `completed` requests."""
    import threading

    def run():
        deadline = time.monotonic() + 30
        while server.stats(attempts=False)["completed"] < completed and time.monotonic() < deadline:
            time.sleep(0.01)
        server_cm.__exit__(None, None, None)
        if then:
            then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_stopped_replica_is_benched_and_its_requests_move_to_the_others(tmp_path):
    config, shard = make_run(tmp_path, [f"replica {i}" for i in range(60)])
    slow = FakeConfig(slots=4, tokens_per_s=400)  # ~0.16 s per request: the run lasts a few seconds
    with run_fake_server(slow) as b:
        a_cm = run_fake_server(slow)
        a = a_cm.__enter__()
        stopper = stop_when(a_cm, a, 10)
        result, pool = generate_keeping_pool(config, shard, [a.base_url, b.base_url], outage_wait_s=30)
        stopper.join(10)
        served_b = b.stats()["completed"]
    accounting(result)
    assert (result.ok, result.failed) == (60, 0)
    assert pool.benched == {a.base_url: 1}, "benched once, then kept out by probes, not by failed requests"
    recs = records(config)
    assert len({r["id"] for r in recs}) == 60
    # A request in flight on A when it stopped lost that attempt and maybe one more finding A
    # refusing; none spent its attempts on A (max_attempts=4).
    assert max(r["attempts"] for r in recs) <= 3
    assert 10 <= 60 - served_b <= 10 + 4, "after the stop A finished at most its 4 slots in flight; B served the rest"
    done = json.loads(paths(Path(config.run_dir) / "generations", shard.name)["done"].read_text())
    assert sum(done["retries"].values()) <= 8


def test_requests_wait_out_a_restart_of_the_only_server(tmp_path):
    from eagle3.serving.managed import free_port

    config, shard = make_run(tmp_path, [f"restart {i}" for i in range(40)])
    slow = FakeConfig(slots=4, tokens_per_s=400)
    port = free_port()
    back = {}

    def restart():
        time.sleep(3.0)  # down for 3 s: longer than the whole backoff budget (4 attempts x <= 0.2 s)
        back["cm"] = run_fake_server(slow, port=port)
        back["server"] = back["cm"].__enter__()

    first_cm = run_fake_server(slow, port=port)
    first = first_cm.__enter__()
    stopper = stop_when(first_cm, first, 8, then=restart)
    started = time.monotonic()
    try:
        result, pool = generate_keeping_pool(config, shard, [first.base_url], outage_wait_s=30)
    finally:
        stopper.join(10)
        if "cm" in back:
            back["cm"].__exit__(None, None, None)
    accounting(result)
    assert (result.ok, result.failed) == (40, 0), "no prompt failed while the server was down"
    assert time.monotonic() - started >= 3.0
    assert pool.benched == {first.base_url: 1}
    assert max(r["attempts"] for r in records(config)) <= 3
    assert not records(config, "failed")


def test_waiting_for_a_dead_server_is_bounded(tmp_path):
    from eagle3.serving.managed import free_port

    config, shard = make_run(tmp_path, [f"dead {i}" for i in range(5)])
    started = time.monotonic()
    result, pool = generate_keeping_pool(config, shard, [f"http://127.0.0.1:{free_port()}/v1"], outage_wait_s=1.0)
    accounting(result)
    assert (result.ok, result.failed, result.retryable) == (0, 5, 5) and not result.complete
    assert result.errors == {"connect_error": 5}
    assert 1.0 <= time.monotonic() - started < 10
