"""The sample-efficiency ablation: one arm at a time, at a reduced and equal data budget, judged live on the
fixed evaluation suite. Its JSON is the lab notebook: every arm, its budget, its result.

    .venv/bin/python benchmarks/bench_sample_efficiency.py --arm NAME [--set KEY=VALUE ...]
        [--data-set KEY=VALUE ...] [--samples 300] [--recipe recipes/smollm2-135m-cpu.toml]

- Data: the recipe's prepare, generate, tokenize, vocab and extract stages with ``data.self_prompts.count
  = --samples`` (and any ``--data-set`` overrides: the data levers) into a run folder named after those
  settings, ``runs/se-data-<hash>``, shared by every arm with the same data (a stage finds its work on
  disk and returns at once, so the second arm pays nothing for data).
- Arm: a folder ``runs/se-arm-<name>`` holding hard links to the data run's stage folders, then train,
  export and evaluate there with the arm's ``--set`` overrides (the training levers). Evaluate measures
  only the trained drafter, on the whole suite, temperature 0, concurrency 1 (each prompt's own counters:
  tokens per target step, pooled and per category, bootstrap 95% interval over prompts).
- Each arm is compared with the arm named ``--baseline`` (default ``baseline``; kept in the arm's record)
  by a paired bootstrap over the suite's prompts (the same prompts, so the prompts' own spread cancels
  out), and only when both trained on the same data: each arm records its data's fingerprint (a hash of
  its generations), and an arm whose data differs from its baseline's gets no difference, it gets the
  reason (rewriting a data run draws new prompts: its arms need a baseline of their own).
- The record of every arm is kept in ``benchmarks/results/sample_efficiency.json`` (rewritten atomically
  after each arm, so a session that ends mid-ablation loses no finished arm), with its wall and CPU
  seconds per stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import results_file  # noqa: E402
from eagle3.durable import read_json  # noqa: E402
from eagle3.evaluate.intervals import paired_difference  # noqa: E402

DATA_STAGES = ("prepare", "generate", "tokenize", "vocab", "extract")
ARM_STAGES = ("train", "export", "evaluate")
LINKED = ("prompts", "generations", "tokenized", "vocab", "hidden_states")
EVALUATE = (
    'evaluate.methods=["trained"]',
    'evaluate.prompt_sets=["suite"]',
    "evaluate.temperatures=[0.0]",
    "evaluate.concurrencies=[1]",
    "evaluate.rounds=1",
    "evaluate.compare_untrained=false",
)
OUT = results_file.RESULTS / "sample_efficiency.json"


def run_stage(stage: str, recipe: str, sets: list[str], log: Path) -> dict:
    """One CLI stage as a child process: its wall and CPU seconds (the child and everything it waited for)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "cli", stage, "--config", recipe, *(a for s in sets for a in ("--set", s))]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n== {' '.join(argv)}\n")
        fh.flush()
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=4 * 3600).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        sys.exit(f"stage {stage} failed (exit {code}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(time.monotonic() - began, 1), "cpu_s": round(cpu, 1)}


def data_dir(samples: int, data_sets: list[str]) -> str:
    key = hashlib.sha256(json.dumps([samples, sorted(data_sets)]).encode()).hexdigest()[:10]
    return f"runs/se-data-{samples}-{key}"


def link_data(data: Path, arm: Path) -> None:
    """The arm's run folder: hard links to the data run's stage folders (stages replace files by rename, never
    write into an input in place, so the data run is never changed through a link)."""
    arm.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        if not (arm / name).exists():
            shutil.copytree(data / name, arm / name, copy_function=os.link)
    if not (arm / "manifest.json").exists():
        shutil.copy2(data / "manifest.json", arm / "manifest.json")


def arm_result(arm: Path) -> dict:
    live = read_json(arm / "evaluate" / "live.json")
    table = live["acceptance"]["suite"]["trained"]
    visit = next(v for v in live["visits"] if v["method"] == "trained" and v["prompt_set"] == "suite")
    manifest = read_json(arm / "manifest.json")["stages"]
    train = manifest.get("train", {})
    return {
        "acceptance_length": table["pooled"]["acceptance_length"],
        "ci95": table["pooled"]["ci95"],
        "by_category": {c: t["acceptance_length"] for c, t in table["categories"].items()},
        "by_category_ci95": {c: t["ci95"] for c, t in table["categories"].items()},
        "acceptance_length_vllm": table["pooled"]["acceptance_length_vllm"],
        "offline_heldout_acceptance_length": (train.get("best") or {}).get("acceptance_length"),
        "train_steps": train.get("in"),
        "train_tokens": train.get("tokens"),
        "suite_fingerprint": live["prompt_sets"]["suite"]["selection"]["fingerprint"],
        "per_prompt": visit["per_prompt"],
    }


def data_fingerprint(run: Path) -> str:
    """A hash of the data run's generations (every shard, in order): equal for arms that trained on the
    same samples, different after the data run was rewritten with a new draw of prompts."""
    digest = hashlib.sha256()
    for shard in sorted((run / "generations").glob("shard-*.jsonl")):
        digest.update(shard.name.encode() + b"\0" + hashlib.sha256(shard.read_bytes()).digest())
    return digest.hexdigest()[:16]


def compare(arm: dict, base: dict | None) -> dict | None:
    """The arm's paired difference to its baseline, or why there is none (None: no baseline recorded yet).
    Arms recorded before fingerprints (no key) share the one draw they were run on."""
    if base is None:
        return None
    if arm.get("data_fingerprint") != base.get("data_fingerprint"):
        return {"refused": "the baseline trained on other data (another draw of prompts)"}
    return paired_difference(arm["per_prompt"], base["per_prompt"])


def supervised_tokens(run: Path) -> int | None:
    entry = read_json(run / "manifest.json")["stages"].get("tokenize", {})
    return entry.get("supervised_tokens") or entry.get("tokens")


def summary_of(arms: dict) -> tuple[dict, dict]:
    """The notebook's summary at the ablation's budget (the sample count most arms trained on): its best arm,
    that arm's own baseline and their paired difference (numbers), and which arms those are (names, kept
    beside the summary). Arms at other budgets (the data curve's points) are named, not ranked: more data is
    not a lever of equal budget."""
    budgets = Counter(a["budget"]["samples"] for a in arms.values())
    budget = max(budgets, key=lambda b: (budgets[b], -b))
    equal = [n for n in arms if arms[n]["budget"]["samples"] == budget]
    best = max(equal, key=lambda n: arms[n]["result"]["acceptance_length"] or 0.0)
    summary, names = {"arms": len(arms), "budget_samples": budget}, {"best": best}
    summary["best_acceptance_length"] = arms[best]["result"]["acceptance_length"]
    summary["best_ci95_low"], summary["best_ci95_high"] = arms[best]["result"]["ci95"]
    base = arms[best].get("baseline")
    if base in arms and base != best:
        names["best_baseline"] = base
        summary["baseline_acceptance_length"] = arms[base]["result"]["acceptance_length"]
        diff = arms[best].get("vs_baseline") or {}
        if diff.get("difference") is not None:
            summary["best_minus_baseline"] = diff["difference"]
    names["at_other_budgets"] = sorted(n for n in arms if n not in equal)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, names


def run_arm(
    arm: str, sets: list[str], data_sets: list[str], samples: int, recipe: str, note: str, prepare_data=None
) -> dict:
    """Make (or find) the data run for ``samples`` and ``data_sets``, train, export and evaluate the arm in
    its own folder; return the arm's record (budget, per-stage seconds, result, per-prompt counters).
    ``prepare_data(data_run)`` runs before the data stages (the scaling curve seeds a run's request store)."""
    began = time.monotonic()
    started = results_file.provenance()
    data_run = data_dir(samples, data_sets)
    common = [f"data.self_prompts.count={samples}", *data_sets]
    (ROOT / data_run).mkdir(parents=True, exist_ok=True)
    if prepare_data is not None:
        prepare_data(ROOT / data_run)
    log = ROOT / data_run / "benchmark.log"
    stages = {}
    for stage in DATA_STAGES:
        stages[stage] = run_stage(stage, recipe, [f'run_dir="{data_run}"', *common], log)
        print(f"data {stage}: {stages[stage]}", flush=True)
    arm_run = f"runs/se-arm-{arm}"
    link_data(ROOT / data_run, ROOT / arm_run)
    arm_sets = [f'run_dir="{arm_run}"', *common, *sets, *EVALUATE]
    for stage in ARM_STAGES:
        stages[stage] = run_stage(stage, recipe, arm_sets, ROOT / arm_run / "benchmark.log")
        print(f"arm {arm} {stage}: {stages[stage]}", flush=True)
    result = arm_result(ROOT / arm_run)
    return {
        "note": note,
        "sets": sets,
        "data_sets": data_sets,
        "budget": {
            "samples": samples,
            "supervised_tokens": supervised_tokens(ROOT / data_run),
            "train_steps": result["train_steps"],
        },
        "stages": stages,
        "cpu_s_train_export_evaluate": round(sum(stages[s]["cpu_s"] for s in ARM_STAGES), 1),
        "cpu_s_data": round(sum(stages[s]["cpu_s"] for s in DATA_STAGES), 1),
        "wall_s": round(time.monotonic() - began, 1),
        "commit": started["commit"],
        "date": started["date"],
        "data_run": data_run,
        "data_fingerprint": data_fingerprint(ROOT / data_run),
        "result": {k: v for k, v in result.items() if k != "per_prompt"},
        "per_prompt": result["per_prompt"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True, help="the arm's name (its run folder and its key in the JSON)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a training lever")
    parser.add_argument("--data-set", dest="data_sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.toml")
    parser.add_argument("--baseline", default="baseline")
    parser.add_argument("--note", default="", help="why this arm: written beside its result")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    started = results_file.provenance()
    record = run_arm(args.arm, args.sets, args.data_sets, args.samples, args.recipe, args.note)
    doc = read_json(Path(args.out)) if Path(args.out).exists() else {}
    arms = doc.get("arms", {})
    arms[args.arm] = {**record, "baseline": args.baseline}
    for name, arm in arms.items():
        base = arm.get("baseline", "baseline")
        if name != base and (diff := compare(arm, arms.get(base))) is not None:
            arm["vs_baseline"] = diff
    summary, summary_arms = summary_of(arms)
    results_file.write(
        args.out,
        "sample_efficiency",
        summary,
        summary_arms=summary_arms,
        started=started,
        recipe=args.recipe,
        baseline=args.baseline,
        protocol=__doc__.split("\n\n", 2)[2],
        arms=arms,
    )
    res = arms[args.arm]["result"]
    print(f"arm {args.arm}: tau {res['acceptance_length']:.3f} {res['ci95']} {res['by_category']}", flush=True)
    if "vs_baseline" in arms[args.arm]:
        print(f"  vs {args.baseline}: {arms[args.arm]['vs_baseline']}", flush=True)


if __name__ == "__main__":
    main()
