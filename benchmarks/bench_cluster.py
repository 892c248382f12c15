"""Shard tasks on a Ray cluster against the single-machine path: the engine's overhead.

    .venv/bin/python benchmarks/bench_cluster.py [--rows 800] [--shards 4] [--rounds 2]

The same tokenize and extract flows (through a temporary Prefect server) on the same inputs, three
ways, each on a fresh copy of the run:
- ``local``: no cluster address, today's path (tokenize shards one after another in the flow's
  process, extraction in waves of extract.replicas = 1).
- ``ray_1node``: a one-node loopback Ray cluster with this machine's cores, every shard task asking
  for all of them, so one task runs at a time as on the local path: the same resources, and the
  difference is the engine (Ray scheduling, a worker process, its model load, prefect-ray's task
  state calls). ``stage_vs_local`` = local seconds / Ray seconds; target >= 0.9.
- ``ray_2nodes``: two nodes with one core each, one shard task per node at a time: what spreading
  buys on this machine (informative; a real cluster adds machines rather than splitting two cores).
Rounds alternate the ways so a shared machine's drift hits all alike; ``local`` runs twice per
round, and the A/A ratio of those two runs is the noise next to each ratio. Results:
benchmarks/results/cluster.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

WORDS = "the drafter learns to guess what the target model writes next from its hidden states".split()


def make_inputs(run: Path, rows: int, shards: int, seed: int = 0) -> None:
    """Prompt shards and finished generation shards with server ids, as the generate stage leaves them."""
    import pyarrow.parquet as pq

    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.generate.records import JsonlAppender
    from eagle3.prepare.stage import run_prepare
    from eagle3.tokenize.build import render_ids
    from eagle3.tokenize.stage import load_tokenizer, tokenizer_path

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


def one_run(base: Path, work: Path, name: str, address: str | None, cpus: int) -> dict:
    """Tokenize, vocab, extract on a fresh copy of ``base``; seconds of tokenize and extract."""
    import ray

    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.manifest import read_manifest
    from flows.extract import extract_flow
    from flows.tokenize import tokenize_flow
    from flows.vocab import vocab_flow

    run = work / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(base, run)
    sets = [f'run_dir="{run}"', "vocab.draft_vocab_size=1000"]
    if address:
        sets += [
            f'cluster.address="{address}"',
            "cluster.extract_gpus=0",
            f"cluster.extract_cpus={cpus}",
            f"cluster.tokenize_cpus={cpus}",
        ]
    config = load_config(DEMO_RECIPE, sets)
    started = time.perf_counter()
    tokenize_flow(config)
    tokenize_s = time.perf_counter() - started
    vocab_flow(config)
    started = time.perf_counter()
    extract_flow(config)
    extract_s = time.perf_counter() - started
    if address:
        ray.shutdown()
    manifest = read_manifest(run)["stages"]
    return {
        "tokenize_s": tokenize_s,
        "extract_s": extract_s,
        "rows": manifest["tokenize"]["ok"],
        "tokens": manifest["extract"]["tokens"],
    }


def machine() -> dict:
    import importlib.metadata as md

    mem = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")), None)
    return {
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": md.version("torch"),
        "ray": md.version("ray"),
        "prefect": md.version("prefect"),
        "prefect_ray": md.version("prefect-ray"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=800)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cluster.json")
    args = parser.parse_args()

    from prefect.testing.utilities import prefect_test_harness
    from ray_cluster import LocalCluster

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    runs: dict[str, list[dict]] = {"local": [], "local_again": [], "ray_1node": [], "ray_2nodes": []}
    try:
        base = work / "base"
        make_inputs(base, args.rows, args.shards)
        with prefect_test_harness(server_startup_timeout=90):
            one_run(base, work, "warm-up", None, cores)  # first import of the model and tokenizer, untimed
            for r in range(args.rounds):
                runs["local"].append(one_run(base, work, f"local-{r}", None, cores))
                with LocalCluster(work / "ray-logs-1", nodes=1, cpus=cores) as cluster:
                    runs["ray_1node"].append(one_run(base, work, f"ray1-{r}", cluster.address, cores))
                runs["local_again"].append(one_run(base, work, f"local-again-{r}", None, cores))
                with LocalCluster(work / "ray-logs-2", nodes=2, cpus=max(1, cores // 2)) as cluster:
                    runs["ray_2nodes"].append(one_run(base, work, f"ray2-{r}", cluster.address, max(1, cores // 2)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(way: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[way])

    def ratio(way: str, key: str) -> float:
        """Per-round local seconds / ``way`` seconds, median over rounds (> 1: ``way`` is faster)."""
        return statistics.median(a[key] / b[key] for a, b in zip(runs["local"], runs[way], strict=True))

    rows, tokens = runs["local"][0]["rows"], runs["local"][0]["tokens"]
    summary = {
        f"{stage}_{way}_vs_local": round(ratio(way, f"{stage}_s"), 3)
        for stage in ("tokenize", "extract")
        for way in ("ray_1node", "ray_2nodes", "local_again")
    }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cluster",
        "commit": commit,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join([sys.executable, *sys.argv]),
        "inputs": {"rows": rows, "shards": args.shards, "tokens": tokens, "rounds": args.rounds},
        "summary": summary,
        "seconds": {
            way: {"tokenize": round(median(way, "tokenize_s"), 2), "extract": round(median(way, "extract_s"), 2)}
            for way in runs
        },
        "throughput": {
            way: {
                "tokenize_rows_per_s": round(rows / median(way, "tokenize_s"), 1),
                "extract_tokens_per_s": round(tokens / median(way, "extract_s"), 1),
            }
            for way in runs
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'way':<12} {'tokenize s':>11} {'extract s':>10} {'tok/s extract':>14} {'vs local':>17}")
    for way in runs:
        s, t = result["seconds"][way], result["throughput"][way]
        vs = (
            ""
            if way == "local"
            else f"{summary[f'tokenize_{way}_vs_local']:.2f} / {summary[f'extract_{way}_vs_local']:.2f}"
        )
        print(f"{way:<12} {s['tokenize']:>11.2f} {s['extract']:>10.2f} {t['extract_tokens_per_s']:>14.0f} {vs:>17}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
