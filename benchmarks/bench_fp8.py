"""fp8 hidden states against bf16 on the real target: disk bytes and the drafter's acceptance.

    .venv/bin/python benchmarks/bench_fp8.py [--base runs/bench-data-single] [--max-steps 120] [--live]

Starts from a finished SmolLM2-135M run (its prompts, generations, tokenized shards and draft
vocabulary; ``benchmarks/bench_training_data.py`` leaves one in runs/bench-data-single) and runs
the extract and train stages three times on copies of it, with the same settings and seed:
``bf16`` (extract.storage_dtype = bfloat16), ``fp8`` (fp8_e4m3) and ``bf16_again`` (the A/A pair:
the run-to-run noise of the same settings). Reported: stored bytes, extraction seconds, and the
held-out offline acceptance length of the trained drafter (the expected accepted tokens of a
K-token chain on held-out samples, the trainer's own evaluation). ``summary.fp8_acceptance_vs_bf16``
(target: within 1%, i.e. >= 0.99) next to ``bf16_aa``. With ``--live`` each drafter is also exported and
measured in vLLM (the trained drafter alone, greedy, 16 prompts of 128 tokens per prompt set, ~4 min a
variant): ``summary.fp8_live_acceptance_vs_bf16_<set>`` next to ``bf16_live_aa_<set>``. Results:
benchmarks/results/fp8.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import results_file

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-cpu.toml"
KEEP = ("prompts", "generations", "tokenized", "vocab", "manifest.json")  # what the copies start from


def sets_of(base: Path) -> list[str]:
    """The --set values the base run was made with (bench_real_target records them), minus run_dir."""
    bench = base / "benchmark.json"
    for candidate in (bench, *sorted((ROOT / "benchmarks" / "results").glob("*.json"))):
        if candidate.exists():
            data = json.loads(candidate.read_text())
            sets = data.get("sets") or []
            if any(s == f'run_dir="{base.relative_to(ROOT)}"' for s in sets):
                return [s for s in sets if not s.startswith("run_dir=")]
    raise SystemExit(f"{base}: no results file records the settings it was made with")


# The live check: the trained drafter alone, greedy, one visit per prompt set (acceptance, not speed, is
# compared, and vLLM's greedy verification makes it deterministic per drafter), 16 prompts x 128 tokens a set.
LIVE = [
    'evaluate.methods=["trained"]',
    "evaluate.temperatures=[0.0]",
    "evaluate.concurrencies=[1]",
    "evaluate.rounds=1",
    "evaluate.compare_untrained=false",
    "evaluate.num_prompts=16",
]


def live_acceptance(run: Path) -> dict:
    """Mean live acceptance length per prompt set, read from the evaluate stage's live.json."""
    doc = json.loads((run / "evaluate" / "live.json").read_text())
    return {c["prompt_set"]: c["mean_acceptance_length"] for c in doc["cells"] if c["method"] == "trained"}


def variant(base: Path, name: str, sets: list[str], live: bool = False) -> dict:
    run = base.parent / f"{base.name}-fp8bench-{name}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    for item in KEEP:
        src = base / item
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, run / item)
    all_sets = [*sets, f'run_dir="{run.relative_to(ROOT)}"']
    seconds = {}
    stages = ("extract", "train", "export", "evaluate") if live else ("extract", "train")
    if live:
        all_sets += LIVE
    for stage in stages:
        argv = [str(ROOT / ".venv" / "bin" / "eagle3"), stage, "--config", str(RECIPE), "--progress", "off"]
        for s in all_sets:
            argv += ["--set", s]
        started = time.perf_counter()
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        seconds[stage] = round(time.perf_counter() - started, 1)
        if out.returncode != 0:
            raise SystemExit(f"{name}: eagle3 {stage} failed:\n{out.stderr[-3000:]}")
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    evals = [json.loads(x) for x in (run / "train" / "eval.jsonl").read_text().splitlines() if x.strip()]
    result = {
        "storage_dtype": stages["extract"].get("storage_dtype", "bfloat16"),
        "bytes": stages["extract"]["bytes"],
        "tokens": stages["extract"]["tokens"],
        "seconds": seconds,
        "best": stages["train"]["best"],
        "final_eval": evals[-1] if evals else None,
    }
    if live:
        result["live_acceptance"] = live_acceptance(run)
    shutil.rmtree(run, ignore_errors=True)
    return result


def partial_path(out: Path) -> Path:
    # under runs/ (ignored), not beside the results the README table is generated from
    return ROOT / "runs" / f"bench-{out.stem}.partial.json"


def finished_variants(out: Path, variants: dict, live: bool) -> dict:
    """Variants a killed run finished with the same settings: each takes ~10-30 minutes, so a rerun resumes."""
    try:
        done = json.loads(partial_path(out).read_text())
    except (OSError, ValueError):
        return {}
    return {
        name: entry["result"]
        for name, entry in done.items()
        if name in variants and entry.get("sets") == variants[name] and entry.get("live") == live
    }


def keep_partial(out: Path, name: str, sets: list[str], live: bool, result: dict) -> None:
    """Each finished variant goes to disk at once (atomic replace), before the next one starts."""
    path = partial_path(out)
    try:
        done = json.loads(path.read_text())
    except (OSError, ValueError):
        done = {}
    done[name] = {"sets": sets, "live": live, "result": result}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(done, indent=2) + "\n")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=ROOT / "runs" / "bench-data-single")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument(
        "--live", action="store_true", help="also export and measure each drafter live in vLLM (~4 min a variant)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fp8.json")
    args = parser.parse_args()
    started = results_file.provenance()
    base = args.base.resolve()
    sets = [s for s in sets_of(base) if not s.startswith("train.max_steps=")] + [f"train.max_steps={args.max_steps}"]
    variants = {
        "bf16": [*sets, 'extract.storage_dtype="bfloat16"'],
        "fp8": [*sets, 'extract.storage_dtype="fp8_e4m3"'],
        "bf16_again": [*sets, 'extract.storage_dtype="bfloat16"'],
    }
    results = finished_variants(args.out, variants, args.live)
    for name, s in variants.items():
        if name in results:
            print(f"{name}: kept from {partial_path(args.out)} (same settings)", flush=True)
            continue
        results[name] = variant(base, name, s, args.live)
        keep_partial(args.out, name, s, args.live, results[name])

    def acceptance(name: str) -> float:
        return results[name]["final_eval"]["acceptance_length"]

    summary = {
        "fp8_acceptance_vs_bf16": round(acceptance("fp8") / acceptance("bf16"), 4),
        "bf16_aa": round(acceptance("bf16_again") / acceptance("bf16"), 4),
        "fp8_bytes_vs_bf16": round(results["fp8"]["bytes"] / results["bf16"]["bytes"], 4),
    }
    if args.live:
        for prompt_set in results["bf16"]["live_acceptance"]:
            live = {name: r["live_acceptance"][prompt_set] for name, r in results.items()}
            summary[f"fp8_live_acceptance_vs_bf16_{prompt_set}"] = round(live["fp8"] / live["bf16"], 4)
            summary[f"bf16_live_aa_{prompt_set}"] = round(live["bf16_again"] / live["bf16"], 4)
    results_file.write(
        args.out, "fp8", summary, started=started, base=str(base.relative_to(ROOT)), sets=sets, variants=results
    )
    partial_path(args.out).unlink(missing_ok=True)
    for name, r in results.items():
        print(
            f"{name:<11} {r['bytes'] / 2**20:>8.1f} MiB  extract {r['seconds']['extract']:>6.1f} s  train "
            f"{r['seconds']['train']:>6.1f} s  acceptance {r['final_eval']['acceptance_length']:.4f}"
        )
    print(json.dumps(summary, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
