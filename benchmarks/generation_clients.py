"""The measured side of benchmarks/bench_generation.py: one client run per process.

    python benchmarks/generation_clients.py --client baseline|pipeline|prefect --url URL --n N --concurrency C
        --run-dir DIR [--shards S] [--max-tokens M] [--greedy] [--profile FILE.prof]

Prints one JSON line: ok, wall_s, cpu_s (getrusage of this process, every thread included, from just
before the first request to just after the last), maxrss_mb. Imports and the pipeline's prepare step
happen before the clock starts, so both numbers measure the requests. --profile runs the measured part
under cProfile and writes its stats there (the CPU numbers of such a run include the profiler's cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

MAX_TOKENS = 512


def usage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024}


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"benchmark prompt {i}: explain item {i % 97} in detail"}] for i in range(n)]


async def baseline(
    url: str, n: int, concurrency: int, max_tokens: int = MAX_TOKENS, key: str | None = None, greedy: bool = False
) -> int:
    """The thinnest reasonable client: httpx, N workers, POST, json.loads, count. No retries, no
    deadlines, nothing written. Split into clients of as many connections as the pipeline's
    (CONNECTIONS_PER_CLIENT): httpcore's pool scan costs CPU per connection in the pool, so a
    different split would measure the split, not the client."""
    import httpx

    from eagle3.serving.client import CONNECTIONS_PER_CLIENT as PER_CLIENT

    todo = iter(prompts(n))
    done = 0
    limits = httpx.Limits(max_connections=PER_CLIENT, max_keepalive_connections=PER_CLIENT)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    tls = httpx.create_ssl_context()  # one for all clients, as the pipeline does (each default one costs ~40 ms)
    clients = [
        httpx.AsyncClient(base_url=url, limits=limits, timeout=600, headers=headers, verify=tls)
        for _ in range(-(-concurrency // PER_CLIENT))
    ]

    async def worker(client):
        nonlocal done
        for messages in todo:
            body = {"model": "fake-target", "messages": messages, "max_tokens": max_tokens, "return_token_ids": True}
            if greedy:
                body.update(temperature=0, top_p=1.0)
            r = await client.post("/chat/completions", json=body)
            json.loads(r.content)
            done += r.status_code == 200

    await asyncio.gather(*(worker(clients[k // PER_CLIENT]) for k in range(concurrency)))
    for client in clients:
        await client.aclose()
    return done


def shard_config(run_dir: Path, n: int, concurrency: int, shards: int = 1, overrides: tuple = ()):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare

    src = run_dir / "prompts.jsonl"
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts(n)))
    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{run_dir}"',
            f'data.source="{src}"',
            f"data.num_shards={shards}",
            f"generation.max_tokens={MAX_TOKENS}",
            f"generation.concurrency={concurrency}",
            "generation.shard_parallelism=2",
            'server.mode="external"',
            'server.model="fake-target"',
            *overrides,
        ],
    )
    run_prepare(config)
    return config


async def pipeline(url: str, config, key: str | None = None) -> int:
    """eagle3.generate.shard.generate_shard, everything included: retry policy, deadlines, a flushed
    append per record (fsync every generation.fsync_every), accounting and the completion marker."""
    from eagle3.generate.shard import generate_shard
    from eagle3.generate.stage import out_dir
    from eagle3.run_facts import RunFacts
    from eagle3.serving.client import EndpointPool

    shards = RunFacts.resolve(config).prompt_shards()
    parallel = min(config.generation.shard_parallelism, len(shards))
    per_shard = max(1, config.generation.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)

    async def one(shard):
        async with limit:
            pool = EndpointPool([url], key, per_shard, 600)
            try:
                return await generate_shard(
                    shard, out_dir(config), config.generation, "fake-target", pool, concurrency=per_shard
                )
            finally:
                await pool.close()

    results = await asyncio.gather(*(one(s) for s in shards))
    return sum(r.ok + r.filtered for r in results)


def prefect(url: str, config) -> tuple[int, float]:
    from prefect.testing.utilities import prefect_test_harness

    from flows.generate import generate_flow

    with prefect_test_harness(server_startup_timeout=90):
        config = config.model_copy(update={"server": config.server.model_copy(update={"urls": [url]})})
        started = time.perf_counter()
        entry = asyncio.run(generate_flow(config))
        return entry["ok"] + entry["filtered"], time.perf_counter() - started


def _measured(args, work) -> tuple[int, float, dict]:
    """Run ``work()`` -> (ok, wall_s or None) between two getrusage reads, under cProfile if asked."""
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    before = usage()
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    ok, wall = work()
    if profiler:
        profiler.disable()
    wall = wall if wall is not None else time.perf_counter() - started
    after = usage()
    if profiler:
        profiler.dump_stats(args.profile)
    return ok, wall, {"cpu_s": after["cpu_s"] - before["cpu_s"], "maxrss_mb": after["maxrss_mb"]}


def client_main(args) -> None:
    import httpx

    import eagle3.generate.shard  # noqa: F401

    httpx.AsyncClient()  # httpx imports its transport (httpcore, h2) at the first client: before the clock

    key = os.environ.get("EAGLE3_BENCH_KEY")
    if args.client == "baseline":
        ok, wall, used = _measured(
            args,
            lambda: (
                asyncio.run(baseline(args.url, args.n, args.concurrency, args.max_tokens, key, args.greedy)),
                None,
            ),
        )
    else:
        greedy = ("generation.temperature=0", "generation.top_p=1.0") if args.greedy else ()
        overrides = (f"generation.max_tokens={args.max_tokens}", *greedy)
        config = shard_config(Path(args.run_dir), args.n, args.concurrency, args.shards, overrides)
        if args.client == "prefect":
            ok, wall, used = _measured(args, lambda: prefect(args.url, config))
        else:
            ok, wall, used = _measured(args, lambda: (asyncio.run(pipeline(args.url, config, key)), None))
    print(json.dumps({"ok": ok, "wall_s": wall, **used}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--client", required=True, choices=["baseline", "pipeline", "prefect"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--greedy", action="store_true", help="temperature 0, top_p 1 (identical work on real vLLM)")
    parser.add_argument("--profile", help="write cProfile stats of the measured part here")
    client_main(parser.parse_args())


if __name__ == "__main__":
    main()
