"""Training on the Ray cluster vs torchrun on one machine, same inputs, same run.

    .venv/bin/python benchmarks/bench_cluster_train.py [--samples 96] [--ttt 7] [--epochs 2] [--repeats 2]

- cluster: ``run_train`` with ``cluster.address`` set, train.nnodes=2 x nproc_per_node=1 on a local
  two-node Ray cluster (tests/ray_cluster.py: two raylets on loopback, 1 CPU each), i.e. the
  placement group, one actor per node, torchrun's static rendezvous and the polled output;
- local: ``run_train`` without a cluster, nproc_per_node=2 (the same world size 2, gloo, CPU).
Both train the tiny Qwen3 target's real extracted states (bench_train.make_run); checkpoints and
evaluation are off during the run, each run starts from scratch, the two alternate and the best of
each is kept. Reported: the trainer's tokens/s (result.json: the training loop) and the stage's wall
time (run_train from request to result: placement, actors, torchrun start-up, teardown).
``summary.cluster_vs_local`` is the best cluster run's training tokens/s over the best local run's;
the repeats are the A/A pairs: ``local_aa`` / ``cluster_aa`` are the second run's tokens/s over the
first's of the same way (--repeats is at least 2 for that reason).
Results: benchmarks/results/cluster_train.json (through benchmarks/results_file.py) and a table on
stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_train import make_run  # noqa: E402
from ray_cluster import LocalCluster  # noqa: E402

import results_file  # noqa: E402


def timed(config, names) -> dict:
    from eagle3.run_facts import RunFacts
    from eagle3.train.stage import run_train

    run = Path(config.run_dir)
    for sub in ("checkpoints", "train"):
        subprocess.run(["rm", "-rf", str(run / sub)], check=True)
    started = time.perf_counter()
    run_train(RunFacts.resolve(config), names)
    wall = time.perf_counter() - started
    result = json.loads((run / "train" / "result.json").read_text())
    losses = [json.loads(x)["loss"] for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    return {
        "tokens": result["tokens"],
        "train_s": result["seconds"],
        "wall_s": wall,
        "world_size": result["world_size"],
        "last_loss": losses[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cluster_train.json"))
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2: the first two runs of each way are its A/A pair")
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-cluster-train-"))
    local, names = make_run(work, args.samples, args.ttt, args.epochs, "train.nproc_per_node=2")
    with LocalCluster(work / "ray-logs", nodes=2, cpus=1) as cluster:
        on_cluster = local.model_copy(
            update={
                "train": local.train.model_copy(update={"nnodes": 2, "nproc_per_node": 1}),
                "cluster": local.cluster.model_copy(
                    update={"address": cluster.address, "train_gpus_per_process": 0.0, "train_cpus_per_process": 1.0}
                ),
            }
        )
        runs: dict[str, list[dict]] = {"local": [], "cluster": []}
        try:
            for _ in range(args.repeats):
                runs["local"].append(timed(local, names))
                runs["cluster"].append(timed(on_cluster, names))
        finally:
            import ray

            ray.shutdown()
    best = {k: min(v, key=lambda r: r["train_s"]) for k, v in runs.items()}
    a, b = best["local"], best["cluster"]
    assert a["tokens"] == b["tokens"] and a["world_size"] == b["world_size"] == 2, (a, b)
    rate = {k: [r["tokens"] / r["train_s"] for r in v] for k, v in runs.items()}
    summary = {
        "cluster_vs_local": round((b["tokens"] / b["train_s"]) / (a["tokens"] / a["train_s"]), 4),
        "local_aa": results_file.aa(rate["local"][0], rate["local"][1]),
        "cluster_aa": results_file.aa(rate["cluster"][0], rate["cluster"][1]),
        "cluster_extra_wall_s": round(b["wall_s"] - a["wall_s"], 1),
    }
    out = results_file.write(
        args.out,
        "cluster_train",
        summary,
        samples=args.samples,
        ttt_steps=args.ttt,
        epochs=args.epochs,
        repeats=args.repeats,
        tokens=a["tokens"],
        local_2proc_tokens_per_s=a["tokens"] / a["train_s"],
        cluster_2nodes_tokens_per_s=b["tokens"] / b["train_s"],
        ratio=summary["cluster_vs_local"],
        local_wall_s=a["wall_s"],
        cluster_wall_s=b["wall_s"],
        last_loss_local=a["last_loss"],
        last_loss_cluster=b["last_loss"],
        runs=runs,
    )
    print("| run | training tokens/s | stage wall s | last loss |")
    print("|---|---|---|---|")
    print(
        f"| torchrun, 1 machine x 2 processes | {out['local_2proc_tokens_per_s']:.0f} | {a['wall_s']:.1f} | "
        f"{a['last_loss']:.4f} |"
    )
    print(
        f"| Ray cluster, 2 nodes x 1 process | {out['cluster_2nodes_tokens_per_s']:.0f} | {b['wall_s']:.1f} | "
        f"{b['last_loss']:.4f} |"
    )
    print(f"cluster / local: {out['ratio']:.2f}")


if __name__ == "__main__":
    main()
