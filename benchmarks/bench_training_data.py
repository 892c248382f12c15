"""Does better training data make a better drafter? Two runs of the SmolLM2 recipe that differ only in
how the training data is made, at the same prompt budget and the same training compute, measured live
in vLLM at temperature 0 and 0.7.

    .venv/bin/python benchmarks/bench_training_data.py [--max-steps 120] [--out benchmarks/results/training_data.json]

- **single**: one answer per prompt, the last user turn answered with the dataset's earlier turns as
  context (data.turns = "last_turn", generation.samples_per_prompt = 1, temperature 0: the recipe's).
- **regenerated**: every assistant turn rewritten by the target in order with its own earlier answers
  in context (data.turns = "regenerate"), two samples per prompt, temperature cycle [0.0, 0.7].

Both read the same prompts: the project's shipped demo conversations (310 readable rows, 42 of them
multi-turn; no dataset can be fetched here), and train for exactly ``--max-steps`` optimizer steps of
``train.batch_tokens`` tokens (train.max_steps), so the comparison is data against data. The held-out
prompts live evaluation sends are chosen by a hash of the prompt id, the same for both runs. Each run
goes through bench_real_target.py (every stage timed through the CLI, resumable), into its own folder.

Results: benchmarks/results/training_data.json through benchmarks/results_file.py. ``summary``:
the regenerated run's live acceptance length over the single run's at T = 0 and 0.7, and the same
for training's offline held-out estimate. No A/A run of a variant (each takes ~20-25 minutes, and
its 120 steps are seeded); the noise shown is what both runs measure alike: the no-speculation
server's decode tokens/s and n-gram's acceptance length on the same held-out prompts at T = 0
(``none_decode_aa``, ``ngram_acceptance_aa``: regenerated's over single's), i.e. the live
measurement's own spread. Training's run-to-run spread is not covered.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import results_file  # noqa: E402

COMMON = [
    'data.source="builtin:demo_prompts"',
    "data.num_shards=2",
    "train.epochs=50",  # never the limit: max_steps is
    'evaluate.methods=["none", "ngram", "trained"]',
    "evaluate.temperatures=[0.0, 0.7]",
    "evaluate.concurrencies=[1]",
    "evaluate.rounds=1",  # acceptance, not speed, is compared: one visit per cell
]
VARIANTS = {
    "single": ['run_dir="runs/bench-data-single"', 'data.turns="last_turn"', "generation.samples_per_prompt=1"],
    "regenerated": [
        'run_dir="runs/bench-data-regenerated"',
        'data.turns="regenerate"',
        "generation.samples_per_prompt=2",
        "generation.temperatures=[0.0, 0.7]",
    ],
}


def run_variant(name: str, sets: list[str], out: Path) -> dict:
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_real_target.py"), "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    began = time.monotonic()
    code = subprocess.run(argv, cwd=ROOT, timeout=6 * 3600).returncode
    if code != 0:
        sys.exit(f"variant {name} failed (exit {code})")
    print(f"{name}: {time.monotonic() - began:.0f} s", flush=True)
    return json.loads(out.read_text())


def at(result: dict, temperature: float) -> dict:
    from eagle3.evaluate.live import headline

    h = headline(result["live"], temperature)
    keep = {k: h.get(k) for k in ("acceptance_length_trained", "acceptance_length_ngram", "speedup_vs_none")}
    return {**keep, "decode_tokens_per_s_none": (h.get("decode_tokens_per_s") or {}).get("none")}


def data_facts(run_dir: Path) -> dict:
    from eagle3.manifest import read_manifest

    stages = read_manifest(run_dir)["stages"]
    gen, tok = stages.get("generate", {}), stages.get("tokenize", {})
    return {
        "samples": gen.get("ok"),
        "variants": gen.get("variants"),
        "shortened": gen.get("shortened"),
        "tokens": tok.get("tokens"),
        "supervised_tokens": tok.get("supervised_tokens"),
        "history_check": {k: v for k, v in (tok.get("template_check") or {}).items() if k.startswith("history")},
    }


def summary_of(rows: dict) -> dict:
    """Regenerated over single for each figure; a figure either run lacks is left out."""

    def ratio(get) -> float | None:
        a, b = get(rows["single"]), get(rows["regenerated"])
        return results_file.aa(a, b) if a and b else None

    summary = {
        "acceptance_regenerated_vs_single_t0": ratio(lambda r: r["t0"]["acceptance_length_trained"]),
        "acceptance_regenerated_vs_single_t07": ratio(lambda r: r["t0.7"]["acceptance_length_trained"]),
        "offline_acceptance_regenerated_vs_single": ratio(lambda r: r["offline_held_out_acceptance"]),
        "none_decode_aa": ratio(lambda r: r["t0"].get("decode_tokens_per_s_none")),
        "ngram_acceptance_aa": ratio(lambda r: r["t0"]["acceptance_length_ngram"]),
    }
    return {k: v for k, v in summary.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=120, help="optimizer steps for both runs (train.max_steps)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "training_data.json"))
    args = parser.parse_args()
    from eagle3.config import load_config

    results, rows = {}, {}
    for name, sets in VARIANTS.items():
        all_sets = [*COMMON, f"train.max_steps={args.max_steps}", *sets]
        out = ROOT / "benchmarks" / "results" / f"training_data_{name}.json"
        results[name] = run_variant(name, all_sets, out)
        run_dir = ROOT / load_config(ROOT / "recipes" / "smollm2-135m-cpu.toml", all_sets).run_dir
        rows[name] = {
            "sets": all_sets,
            "data": data_facts(run_dir),
            "train_steps": results[name]["stages"].get("train", {}).get("ok"),
            "offline_held_out_acceptance": results[name]["offline"]["held_out_acceptance_length"],
            "t0": at(results[name], 0.0),
            "t0.7": at(results[name], 0.7),
        }
    summary = summary_of(rows)
    results_file.write(args.out, "training_data", summary, max_steps=args.max_steps, variants=rows)
    print(json.dumps(summary, indent=2))
    for name, row in rows.items():
        print(
            name,
            row["data"]["samples"],
            "samples",
            row["data"]["tokens"],
            "tokens;",
            "T=0",
            row["t0"],
            "T=0.7",
            row["t0.7"],
        )


if __name__ == "__main__":
    main()
