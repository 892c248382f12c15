"""fp8 hidden states against bf16 on the real target: disk bytes and the drafter's acceptance.

    .venv/bin/python benchmarks/bench_fp8.py [--base runs/bench-data-single] [--max-steps 120]

Starts from a finished SmolLM2-135M run (its prompts, generations, tokenized shards and draft
vocabulary; ``benchmarks/bench_training_data.py`` leaves one in runs/bench-data-single) and runs
the extract and train stages three times on copies of it, with the same settings and seed:
``bf16`` (extract.storage_dtype = bfloat16), ``fp8`` (fp8_e4m3) and ``bf16_again`` (the A/A pair:
the run-to-run noise of the same settings). Reported: stored bytes, extraction seconds, and the
held-out offline acceptance length of the trained drafter (the expected accepted tokens of a
K-token chain on held-out samples, the trainer's own evaluation). ``summary.fp8_acceptance_vs_bf16``
(target: within 1%, i.e. >= 0.99) next to ``bf16_aa``. Live acceptance in vLLM is not measured
here (it needs the evaluate stage's ~30 minutes per variant on 2 cores). Results:
benchmarks/results/fp8.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import results_file  # noqa: E402

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


def variant(base: Path, name: str, sets: list[str]) -> dict:
    run = base.parent / f"{base.name}-fp8bench-{name}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    for item in KEEP:
        src = base / item
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, run / item)
    all_sets = [*sets, f'run_dir="{run.relative_to(ROOT)}"']
    seconds = {}
    for stage in ("extract", "train"):
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
    shutil.rmtree(run, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=ROOT / "runs" / "bench-data-single")
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fp8.json")
    args = parser.parse_args()
    base = args.base.resolve()
    sets = [s for s in sets_of(base) if not s.startswith("train.max_steps=")] + [f"train.max_steps={args.max_steps}"]
    variants = {
        "bf16": [*sets, 'extract.storage_dtype="bfloat16"'],
        "fp8": [*sets, 'extract.storage_dtype="fp8_e4m3"'],
        "bf16_again": [*sets, 'extract.storage_dtype="bfloat16"'],
    }
    results = {name: variant(base, name, s) for name, s in variants.items()}

    def acceptance(name: str) -> float:
        return results[name]["final_eval"]["acceptance_length"]

    summary = {
        "fp8_acceptance_vs_bf16": round(acceptance("fp8") / acceptance("bf16"), 4),
        "bf16_aa": round(acceptance("bf16_again") / acceptance("bf16"), 4),
        "fp8_bytes_vs_bf16": round(results["fp8"]["bytes"] / results["bf16"]["bytes"], 4),
    }
    results_file.write(args.out, "fp8", summary, base=str(base.relative_to(ROOT)), sets=sets, variants=results)
    for name, r in results.items():
        print(
            f"{name:<11} {r['bytes'] / 2**20:>8.1f} MiB  extract {r['seconds']['extract']:>6.1f} s  train "
            f"{r['seconds']['train']:>6.1f} s  acceptance {r['final_eval']['acceptance_length']:.4f}"
        )
    print(json.dumps(summary, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
