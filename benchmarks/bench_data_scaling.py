"""How much data does a drafter need? Acceptance on the fixed suite against supervised tokens, fitted and
extrapolated to the size that would reach tau 3 (and the issue's 2.3).

    .venv/bin/python benchmarks/bench_data_scaling.py --samples N   # one point: data, train, export, evaluate
    .venv/bin/python benchmarks/bench_data_scaling.py --fit-only    # refit and replot from the JSON

- A point is an arm of the sample-efficiency harness (``bench_sample_efficiency.run_arm``): the recipe as
  shipped, ``data.self_prompts.count = N``, trained and judged live on the whole suite at temperature 0,
  concurrency 1. One point per call, so each finished point is on disk (and can be committed) before the
  next starts; the JSON is rewritten atomically after each.
- Nested data: before a point's data stages run, its run folder's self-prompt request store
  (``prompts/self/requests-*.jsonl``) is seeded with a copy of the largest one another point has written.
  Self-prompts keep the first N requests that pass the filters, in request order, so the prompts of a
  smaller point are the first prompts of a larger one and the curve measures more data, not other data
  (answers are greedy, so a prompt's answer is the same in every point).
- The fit: tau = a + b ln(supervised tokens), least squares over the points. With the suite's per-prompt
  counters kept for every point, the same prompts are resampled for all points together (a paired
  percentile bootstrap) and the fit redone, which gives an interval for the slope and for the extrapolated
  sizes. An extrapolation far beyond the largest point is a guess about the shape of the curve as much as
  a measurement; the JSON says how far beyond it reaches.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
from bench_sample_efficiency import run_arm  # noqa: E402

import results_file  # noqa: E402
from eagle3.durable import read_json  # noqa: E402

OUT = results_file.RESULTS / "data_scaling.json"
PLOT = results_file.RESULTS / "data_scaling.png"
TARGETS = (2.3, 3.0)
RESAMPLES = 2_000
SEED = 0


def seed_requests(data_run: Path) -> None:
    """Copy the largest self-prompt request store among the other scaling points into ``data_run`` (a copy:
    the stage appends to it)."""
    here = data_run / "prompts" / "self"
    if here.exists() and any(here.glob("requests-*.jsonl")):
        return
    stores = [p for p in ROOT.glob("runs/se-data-*/prompts/self/requests-*.jsonl") if not p.is_relative_to(data_run)]
    if not stores:
        return
    best = max(stores, key=lambda p: p.stat().st_size)
    here.mkdir(parents=True, exist_ok=True)
    shutil.copy2(best, here / best.name)
    print(f"seeded {here / best.name} from {best}", flush=True)


def tau(rows: list[dict]) -> float:
    n = sum(r["completion_tokens"] for r in rows)
    return n / (n - sum(r["accepted_tokens"] for r in rows))


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def tokens_for(target: float, a: float, b: float) -> float | None:
    if b <= 0:
        return None
    power = (target - a) / b
    return math.exp(power) if power < 700 else math.inf


def fit(points: dict) -> tuple[dict, dict]:
    """(summary, fit record) from the points recorded so far."""
    names = sorted(points, key=lambda n: points[n]["budget"]["supervised_tokens"])
    tokens = np.array([points[n]["budget"]["supervised_tokens"] for n in names], dtype=float)
    samples = np.array([points[n]["budget"]["samples"] for n in names], dtype=float)
    taus = np.array([points[n]["result"]["acceptance_length"] for n in names])
    summary: dict = {
        "points": len(names),
        "largest_samples": int(samples[-1]),
        "largest_supervised_tokens": int(tokens[-1]),
        "tau_at_largest": round(float(taus[-1]), 4),
        "tau_at_smallest": round(float(taus[0]), 4),
    }
    record: dict = {"model": "tau = a + b ln(supervised_tokens)", "points": []}
    for n, t, s, y in zip(names, tokens, samples, taus):
        record["points"].append(
            {
                "arm": n,
                "samples": int(s),
                "supervised_tokens": int(t),
                "tau": round(float(y), 4),
                "ci95": points[n]["result"]["ci95"],
            }
        )
    if len(names) < 2:
        return summary, record
    x = np.log(tokens)
    a, b = fit_line(x, taus)
    residual = taus - (a + b * x)
    ss = float(((taus - taus.mean()) ** 2).sum())
    tokens_per_sample = float(tokens[-1] / samples[-1])
    summary.update(
        {
            "fit_intercept": round(a, 4),
            "fit_slope_per_ln_token": round(b, 4),
            "tau_gain_per_doubling": round(b * math.log(2), 4),
            "fit_r2": round(1 - float((residual**2).sum()) / ss, 4) if ss > 0 else 1.0,
        }
    )
    # the same prompts resampled for every point at once
    rows = [{r["id"]: r for r in points[n]["per_prompt"] if r.get("ok")} for n in names]
    ids = sorted(set.intersection(*(set(r) for r in rows)))
    rng = np.random.default_rng(SEED)
    slopes, sizes = [], {t: [] for t in TARGETS}
    for _ in range(RESAMPLES):
        pick = [ids[i] for i in rng.integers(0, len(ids), len(ids))]
        ys = np.array([tau([r[i] for i in pick]) for r in rows])
        ra, rb = fit_line(x, ys)
        slopes.append(rb)
        for t in TARGETS:
            sizes[t].append(min(tokens_for(t, ra, rb) or math.inf, 1e300))
    summary["tau_gain_per_doubling_ci95_low"] = round(float(np.percentile(slopes, 2.5)) * math.log(2), 4)
    summary["tau_gain_per_doubling_ci95_high"] = round(float(np.percentile(slopes, 97.5)) * math.log(2), 4)
    for t in TARGETS:
        key = str(t).replace(".", "_")
        point = tokens_for(t, a, b)
        if point is None:
            continue
        lo, hi = np.percentile(sizes[t], [2.5, 97.5])
        summary[f"supervised_tokens_for_tau_{key}"] = float(f"{point:.3g}")
        summary[f"samples_for_tau_{key}"] = float(f"{point / tokens_per_sample:.3g}")
        summary[f"samples_for_tau_{key}_ci95_low"] = float(f"{lo / tokens_per_sample:.3g}")
        if hi < 1e300:
            summary[f"samples_for_tau_{key}_ci95_high"] = float(f"{hi / tokens_per_sample:.3g}")
        summary[f"doublings_beyond_largest_for_tau_{key}"] = round(math.log2(point / tokens[-1]), 2)
    record["tokens_per_sample_at_largest"] = round(tokens_per_sample, 1)
    record["bootstrap"] = {"resamples": RESAMPLES, "seed": SEED, "prompts": len(ids), "paired": True}
    return summary, record


def plot(points: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(points, key=lambda n: points[n]["budget"]["supervised_tokens"])
    tokens = [points[n]["budget"]["supervised_tokens"] for n in names]
    taus = [points[n]["result"]["acceptance_length"] for n in names]
    lows = [taus[i] - points[n]["result"]["ci95"][0] for i, n in enumerate(names)]
    highs = [points[n]["result"]["ci95"][1] - taus[i] for i, n in enumerate(names)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.errorbar(tokens, taus, yerr=[lows, highs], fmt="o", capsize=3, label="trained drafter (suite, 95% CI)")
    if "fit_intercept" in summary:
        a, b = summary["fit_intercept"], summary["fit_slope_per_ln_token"]
        far = max([tokens[-1] * 2] + [summary.get("supervised_tokens_for_tau_3_0", 0)])
        xs = np.geomspace(tokens[0] / 1.5, far, 100)
        ax.plot(xs, a + b * np.log(xs), "--", label=f"fit: +{summary['tau_gain_per_doubling']:.3f} per doubling")
    for t in TARGETS:
        ax.axhline(t, color="grey", lw=0.8, ls=":")
        ax.text(tokens[0] / 1.4, t + 0.02, f"tau {t}", color="grey", fontsize=8)
    free = results_file.RESULTS / "free_speculators.json"
    ngram = read_json(free)["summary"].get("acceptance_length_ngram_best") if free.exists() else None
    if ngram:  # the free speculator the drafter has to beat, measured on the same suite
        ax.axhline(ngram, color="tab:red", lw=0.8, ls="-.")
        ax.text(tokens[0] / 1.4, ngram + 0.02, f"n-gram at its best {ngram:.2f}", color="tab:red", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("supervised tokens (log)")
    ax.set_ylabel("tokens per target step (tau), K = 3, T = 0")
    ax.set_title("SmolLM2-135M drafter: acceptance against data")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    tmp.replace(path)


def write(points: dict, recipe: str, started: dict | None) -> None:
    summary, record = fit(points)
    doc = {"started": started} if started else {}
    results_file.write(
        OUT,
        "data_scaling",
        summary,
        **doc,
        recipe=recipe,
        protocol=__doc__.split("\n\n", 2)[2],
        fit=record,
        arms=points,
        plot=str(PLOT.relative_to(ROOT)),
    )
    plot(points, summary, PLOT)
    print({k: v for k, v in summary.items()}, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, help="one point: this many self-written prompts")
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.toml")
    parser.add_argument("--fit-only", action="store_true", help="refit and replot the points on record")
    args = parser.parse_args()
    points = read_json(OUT).get("arms", {}) if OUT.exists() else {}
    started = None
    if not args.fit_only:
        if not args.samples:
            parser.error("--samples N (or --fit-only)")
        started = results_file.provenance()
        name = f"scale-{args.samples}"
        note = f"the recipe as shipped, {args.samples} self-written prompts (nested in the larger points' prompts)"
        points[name] = run_arm(name, [], [], args.samples, args.recipe, note, prepare_data=seed_requests)
    if not points:
        sys.exit(f"{OUT}: no points yet; run with --samples N")
    write(points, args.recipe, started)


if __name__ == "__main__":
    main()
