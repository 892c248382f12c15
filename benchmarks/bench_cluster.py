"""Shard tasks on a Ray cluster against the single-machine path: the engine's overhead.

    .venv/bin/python benchmarks/bench_cluster.py [--rows 4000] [--shards 4] [--rounds 2]

The same tokenize and extract flows (through a temporary Prefect server) on the same inputs, on a
fresh copy of the run each time, two ways:
- ``local``: no cluster address, today's path (tokenize shards one after another in the flow's
  process, extraction in waves of extract.replicas = 1).
- ``ray``: a one-node loopback Ray cluster with this machine's cores, every shard task asking for
  all of them, so one task runs at a time as on the local path: the same resources, and the
  difference is the engine (Ray scheduling, a worker process, prefect-ray's task state calls).
The driver joins the cluster once, as one pipeline run does; its first run on the cluster is
timed apart (``cold``: Ray starts and imports a worker process, which loads the tokenizer and
the target), the rounds after it measure the steady state. ``summary.<stage>_ray_vs_local`` =
local seconds / Ray seconds per round, median over rounds (target >= 0.9); each way runs twice
per round, and the ratio of those two runs (``*_aa``) is the noise next to it. Results:
benchmarks/results/cluster.json (through benchmarks/results_file.py) and a table on stdout.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import results_file  # noqa: E402

WORDS = "the drafter learns to guess what the target model writes next from its hidden states".split()


def make_inputs(run: Path, rows: int, shards: int, seed: int = 0) -> None:
    """Prompt shards and finished generation shards with server ids, as the generate stage leaves them."""
    import pyarrow.parquet as pq

    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare
    from eagle3.records import JsonlAppender
    from eagle3.tokenize.build import render_ids
    from eagle3.tokenizer import load_tokenizer, tokenizer_path

    rng = random.Random(seed)
    src = run.parent / f"{run.name}-prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{i}: " + " ".join(rng.choices(WORDS, k=20))}]})
            + "\n"
            for i in range(rows)
        )
    )
    config = load_config(DEMO_RECIPE, [f'run_dir="{run}"', f'data.source="{src}"', f"data.num_shards={shards}"])
    run_prepare(config)
    tok = load_tokenizer(tokenizer_path(config))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = run / "generations"
    gen.mkdir(exist_ok=True)
    for s in range(shards):
        table = pq.read_table(run / "prompts" / f"shard-{s:05d}.parquet").to_pylist()
        with JsonlAppender(gen / f"shard-{s:05d}.jsonl", fsync_every=10_000) as out:
            for row in table:
                text = " ".join(rng.choices(WORDS, k=rng.randint(40, 160)))
                answer = tok.encode(f"thinking\n</think>\n\n{text}", add_special_tokens=False) + [end]
                out.append(
                    {
                        "id": row["id"],
                        "prompt_token_ids": render_ids(tok, row["messages"], add_generation_prompt=True),
                        "completion_token_ids": answer,
                        "reasoning": "thinking",
                        "content": text,
                        "finish_reason": "stop",
                    }
                )
        (gen / f"shard-{s:05d}.done.json").write_text("{}")


def one_run(base: Path, work: Path, stage: str, name: str, address: str | None, cores: int) -> float:
    """Seconds of one stage's flow on a fresh copy of ``base`` (which holds that stage's inputs)."""
    from eagle3.config import DEMO_RECIPE, load_config
    from flows.extract import extract_flow
    from flows.tokenize import tokenize_flow

    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run)
    sets = [f'run_dir="{run}"', "vocab.draft_vocab_size=1000"]
    if address:
        sets += [
            f'cluster.address="{address}"',
            "cluster.extract_gpus=0",
            f"cluster.extract_cpus={cores}",
            f"cluster.tokenize_cpus={cores}",
        ]
    config = load_config(DEMO_RECIPE, sets)
    started = time.perf_counter()
    (tokenize_flow if stage == "tokenize" else extract_flow)(config)
    seconds = time.perf_counter() - started
    shutil.rmtree(run, ignore_errors=True)
    return seconds


def tokenized_base(base: Path, rows: int, shards: int) -> None:
    """Inputs of the extract stage: tokenized shards and the draft vocabulary, made once, untimed."""
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.run_facts import RunFacts
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer
    from eagle3.vocab.stage import run_vocab

    make_inputs(base, rows, shards, seed=1)
    config = load_config(DEMO_RECIPE, [f'run_dir="{base}"', "vocab.draft_vocab_size=1000"])
    names = [f"shard-{s:05d}.parquet" for s in range(shards)]
    facts = RunFacts.resolve(config)
    tok = load_tokenizer(facts.tokenizer()[0])
    for name in names:
        tokenize_shard(facts, name, tok)
    run_vocab(facts, names)


def counts(base: Path, stage: str) -> int:
    """Rows (tokenize) or tokens (extract) the stage processes from ``base``."""
    import pyarrow.parquet as pq

    if stage == "tokenize":
        return sum(len(p.read_text().splitlines()) for p in (base / "generations").glob("shard-*.jsonl"))
    return sum(
        sum(pq.read_table(p, columns=["num_tokens"]).column("num_tokens").to_pylist())
        for p in (base / "tokenized").glob("shard-*.parquet")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenize-rows", type=int, default=100_000)
    parser.add_argument("--extract-rows", type=int, default=4_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cluster.json")
    args = parser.parse_args()

    import ray
    from prefect.testing.utilities import prefect_test_harness
    from ray_cluster import LocalCluster

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    stages = ("tokenize", "extract")
    ways = ("local", "ray", "local_again", "ray_again")
    seconds: dict[str, dict[str, list[float]]] = {stage: {way: [] for way in ways} for stage in stages}
    cold: dict[str, float] = {}
    try:
        bases = {"tokenize": work / "base-tokenize", "extract": work / "base-extract"}
        make_inputs(bases["tokenize"], args.tokenize_rows, args.shards)
        tokenized_base(bases["extract"], args.extract_rows, args.shards)
        units = {stage: counts(bases[stage], stage) for stage in stages}
        with prefect_test_harness(server_startup_timeout=90), LocalCluster(work / "ray-logs", 1, cores) as cluster:
            for stage in stages:  # the flow process's first model and tokenizer load, untimed
                one_run(bases[stage], work, stage, "warm-up", None, cores)
            for stage in stages:  # the driver's first work on the cluster: a worker process starts
                cold[stage] = one_run(bases[stage], work, stage, "cold", cluster.address, cores)
            for r in range(args.rounds):
                for stage in stages:
                    for way in ways:
                        address = cluster.address if way.startswith("ray") else None
                        seconds[stage][way].append(one_run(bases[stage], work, stage, f"{way}-{r}", address, cores))
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratio(stage: str, a: str, b: str) -> float:
        """Per-round ``a`` seconds / ``b`` seconds, median over rounds (> 1: ``b`` is faster)."""
        pairs = zip(seconds[stage][a], seconds[stage][b], strict=True)
        return round(statistics.median(x / y for x, y in pairs), 3)

    summary = {}
    for stage in stages:
        summary[f"{stage}_ray_vs_local"] = ratio(stage, "local", "ray")
        summary[f"{stage}_ray_again_vs_local_again"] = ratio(stage, "local_again", "ray_again")
        summary[f"{stage}_local_aa"] = ratio(stage, "local", "local_again")
        summary[f"{stage}_ray_aa"] = ratio(stage, "ray", "ray_again")
        summary[f"{stage}_cold_extra_s"] = round(cold[stage] - statistics.median(seconds[stage]["ray"]), 2)
    unit = {"tokenize": "rows", "extract": "tokens"}
    result = results_file.write(
        args.out,
        "cluster",
        summary,
        versions={name: md.version(name) for name in ("ray", "prefect", "prefect-ray")},
        inputs={
            "tokenize_rows": units["tokenize"],
            "extract_tokens": units["extract"],
            "extract_rows": args.extract_rows,
            "shards": args.shards,
            "rounds": args.rounds,
        },
        median_seconds={
            stage: {
                **{way: round(statistics.median(v), 2) for way, v in seconds[stage].items()},
                "ray_cold": round(cold[stage], 2),
            }
            for stage in stages
        },
        throughput={
            stage: {
                f"{way}_{unit[stage]}_per_s": round(units[stage] / statistics.median(v), 1)
                for way, v in seconds[stage].items()
            }
            for stage in stages
        },
        seconds=seconds,
    )
    for stage in stages:
        print(f"{stage}: {units[stage]} {unit[stage]} in {args.shards} shards, {args.rounds} rounds")
        for way, v in result["median_seconds"][stage].items():
            print(f"  {way:<12} {v:>8.2f} s  {units[stage] / v:>10.0f} {unit[stage]}/s")
    print(json.dumps(summary, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
