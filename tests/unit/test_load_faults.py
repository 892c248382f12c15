"""Load with faults, scaled down from benchmarks/bench_load.py (50k at 1024): 3,000 prompts in 4
shards at concurrency 256 against the fake server (its own process) failing 5% of attempts with
hangs, 429s, 5xx and TCP resets. Nothing is lost, nothing is duplicated, every count adds up, and
every injected fault is seen by the client as a retry or a recorded failure of its kind."""

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.generate.shard import generate_shard, paths
from eagle3.generate.stage import out_dir
from eagle3.prepare.stage import run_prepare
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool, deadline_s
from fake_openai import FakeConfig, FaultRule, completion_for, run_fake_server

N, SHARDS, CONCURRENCY = 3000, 4, 256
EXHAUSTED = "exhaust me"  # a 503 on its first 3 attempts: fails pass 1 with max_attempts=3, resumed by pass 2


def _run(tmp_path):
    src = tmp_path / "prompts.jsonl"
    texts = [f"load test prompt {i}" for i in range(N - 1)] + [f"please {EXHAUSTED} now"]
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'data.source="{src}"',
            f"data.num_shards={SHARDS}",
            "generation.max_tokens=64",
            f"generation.concurrency={CONCURRENCY}",
            f"generation.shard_parallelism={SHARDS}",
            "generation.request_timeout_s=10",
            "generation.max_attempts=3",
            "generation.backoff_base_s=0.05",
            "generation.backoff_max_s=0.2",
            'server.mode="external"',
            'server.model="fake-target"',
        ],
    )
    run_prepare(config)
    return config


async def _pass(url, config, shards):
    """One pass, split and bounded as flows/generate.py does; each shard's marker after it."""
    gen = config.generation
    parallel = min(gen.shard_parallelism, len(shards))
    per_shard, limit = gen.concurrency // parallel, asyncio.Semaphore(parallel)

    async def one(shard):
        async with limit:
            pool = EndpointPool([url], None, per_shard, deadline_s(gen), outage_wait_s=config.server.outage_wait_s)
            try:
                result = await generate_shard(shard, out_dir(config), gen, "fake-target", pool, concurrency=per_shard)
            finally:
                await pool.close()
        return result, json.loads(paths(out_dir(config), shard.name)["done"].read_text())

    return await asyncio.gather(*(one(s) for s in shards))


def _on_disk(config):
    """Per stream, how many records each id has; and the prompts of each shard."""
    import pyarrow.parquet as pq

    streams, prompts = {k: Counter() for k in ("ok", "filtered", "failed")}, {}
    for shard in RunFacts.resolve(config).prompt_shards():
        table = pq.read_table(shard, columns=["id", "messages"])
        prompts.update(zip(table.column("id").to_pylist(), table.column("messages").to_pylist()))
        p = paths(out_dir(config), shard.name)
        for kind, counts in streams.items():
            if p[kind].exists():
                counts.update(json.loads(line)["id"] for line in p[kind].read_text().splitlines())
    return streams, prompts


def test_3000_prompts_with_5_percent_faults_lose_and_duplicate_nothing(tmp_path):
    config = _run(tmp_path)
    fake = FakeConfig(
        fault_rate=0.05,
        fault_mix={"hang": 0.25, "429": 0.25, "5xx": 0.25, "reset": 0.25},
        fault_retry_after=0.1,
        rules=[FaultRule(EXHAUSTED, "status", times=3, status=503)],
        seed=7,
    )
    started = time.monotonic()
    passes, retries, failure_records = [], Counter(), Counter()
    with run_fake_server(fake, in_thread=False) as server:
        todo = list(RunFacts.resolve(config).prompt_shards())
        for _ in range(1 + config.generation.shard_retries):  # pass 1, then resumes as the Prefect task retry does
            rows = asyncio.run(_pass(server.base_url, config, todo))
            passes.append(rows)
            for result, marker in rows:
                retries.update(marker["retries"])
                assert marker["counts"]["in"] == result.ok + result.failed + result.filtered == result.in_
            todo = [Path(config.run_dir) / "prompts" / r.shard for r, _ in rows if not r.complete]
            if not todo:
                break
        stats = server.stats(attempts=False)
    elapsed = time.monotonic() - started

    # Pass 1 left the exhausted prompt failed (transient), and a resume pass finished it.
    first = passes[0]
    assert sum(r.in_ for r, _ in first) == N
    assert sum(r.retryable for r, _ in first) >= 1 and len(passes) >= 2
    assert not todo, f"shards still incomplete after {len(passes)} passes"

    streams, prompts = _on_disk(config)
    done = streams["ok"] + streams["filtered"]
    lost = set(prompts) - set(done) - set(streams["failed"])
    duplicated = [i for i, n in done.items() if n > 1]
    assert not lost and not duplicated
    assert len(set(done)) == N and set(done) == set(prompts)  # every prompt finished, none failed in the end
    last = [m for rows in passes for _, m in rows]
    final = {m["input_sha256"]: m["counts"] for m in last}  # the last marker of each shard
    assert sum(c["in"] for c in final.values()) == N
    assert sum(c["ok"] + c["filtered"] for c in final.values()) == N and sum(c["failed"] for c in final.values()) == 0

    # Every injected fault reached the client as a retry or a recorded failure of its own kind.
    for stream in (paths(out_dir(config), s.name)["failed"] for s in RunFacts.resolve(config).prompt_shards()):
        if stream.exists():
            failure_records.update(json.loads(line)["error_kind"] for line in stream.read_text().splitlines())
    seen = retries + failure_records
    faults = Counter(stats["faults"])
    assert {"hang", "reset", "429"} <= set(faults) and faults["500"] + faults["502"] + faults["503"] + faults["504"] > 0
    # The deadline (10 s) is well above the time a healthy request spends in flight (256 in flight /
    # ~150-300 req/s here, Little's law); a deadline below that makes healthy requests time out and
    # be sent again. A fault answered after its attempt's deadline is seen as a timeout (a loaded client loop), so
    # per kind the client sees at most what was injected, and in all at least as many failures.
    for code in ("429", "500", "502", "503", "504"):
        assert seen[f"http_{code}"] <= faults[code], (code, seen, faults)
    assert seen["connection_error"] <= faults["reset"]
    assert sum(seen.values()) >= sum(faults.values()), (seen, faults)
    assert set(seen) <= {"timeout", "connection_error", "http_429", "http_500", "http_502", "http_503", "http_504"}, (
        seen
    )
    assert 0.03 < sum(faults.values()) / stats["requests_total"] < 0.07

    # What was kept is what the server sent, token for token (a sample).
    for record in [
        json.loads(line) for line in paths(out_dir(config), "shard-00000.parquet")["ok"].read_text().splitlines()[:200]
    ]:
        prompt_ids, completion = completion_for(fake, prompts[record["id"]], 64)
        assert record["prompt_token_ids"] == prompt_ids and record["completion_token_ids"] == completion.token_ids
    assert elapsed < 60, f"took {elapsed:.1f} s"
