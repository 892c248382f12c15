"""benchmarks/README.md's generated tables for the fixed evaluation suite: the free speculators
(results/free_speculators.json) and the sample-efficiency ablation (results/sample_efficiency.json)."""

from __future__ import annotations

from pathlib import Path

from table_format import interval, num, table


def free_speculator_methods(results: dict[str, dict]) -> str:
    """Per method served live on the suite: tokens per target step pooled (interval) and per category,
    vLLM's own counter ratio, decode tokens/s."""
    data = results["free_speculators"]
    cats = list(next(iter(data["tables"].values()))["categories"])
    rows = []
    for name, t in data["tables"].items():
        spec = (data["measurements"].get(name) or {}).get("speculative_config") or {}
        setting = (
            f"{spec['prompt_lookup_min']}-{spec['prompt_lookup_max']}, K={spec['num_speculative_tokens']}"
            if spec.get("method") == "ngram"
            else spec.get("method", name)
        )
        rows.append(
            [name, setting, f"**{num(t['pooled']['acceptance_length'], 2)}**", interval(t["pooled"]["ci95"])]
            + [num(t["categories"][c]["acceptance_length"], 2) for c in cats]
            + [num(t["pooled"].get("acceptance_length_vllm"), 2), num(data["decode_tokens_per_s"].get(name), 1)]
        )
    head = ["method", "n-gram min-max, K", "tokens per step", "95% interval", *cats, "vLLM's ratio", "decode tok/s"]
    return table(head, rows)


def free_speculator_grid(results: dict[str, dict]) -> str:
    """The n-gram grid replayed over the no-speculation answers, best first (the first 8 and the last)."""
    grid = results["free_speculators"]["grid"]
    shown = grid[:8] + grid[-1:]
    cats = list(shown[0]["by_category"])
    rows = [
        [g["prompt_lookup_min"], g["prompt_lookup_max"], g["k"], f"**{num(g['acceptance_length'], 3)}**"]
        + [interval(g["ci95"])]
        + [num(g["by_category"][c], 2) for c in cats]
        for g in shown
    ]
    return table(["min", "max", "K", "tokens per step", "95% interval", *cats], rows)


def sample_efficiency_arms(results: dict[str, dict]) -> str:
    """The lab notebook: per arm its levers, budget, tau on the suite with its interval, per category, the
    paired difference to the baseline, and its CPU seconds."""
    data = results["sample_efficiency"]
    arms = data["arms"]
    cats = list(next(iter(arms.values()))["result"]["by_category"])
    rows = []
    for name, a in arms.items():
        r, diff = a["result"], a.get("vs_baseline") or {}
        levers = ", ".join(f"`{s}`" for s in [*a["data_sets"], *a["sets"]]) or "(recipe)"
        against = a.get("baseline", "baseline")  # arms before per-arm baselines were all against "baseline"
        if diff.get("difference") is not None:
            change = f"{num(diff['difference'], 3)} {interval(diff['ci95'])} vs {against}"
        else:
            change = f"- ({diff['refused']})" if "refused" in diff else "-"
        rows.append(
            [name, levers, a["budget"]["samples"], f"**{num(r['acceptance_length'], 3)}**", interval(r["ci95"])]
            + [num(r["by_category"][c], 2) for c in cats]
            + [change, num(r.get("offline_heldout_acceptance_length"), 3), num(a["cpu_s_train_export_evaluate"], 0)]
        )
    head = ["arm", "levers", "samples", "tau (suite)", "95% interval", *cats, "vs its baseline (paired)"]
    return table(head + ["offline held-out tau", "CPU s (train+export+eval)"], rows)


def _count(value) -> str:
    """A count that may be astronomically extrapolated: grouped digits up to ten million, else 3 digits."""
    return f"{value:,.0f}" if value < 1e7 else f"{value:.2g}"


def data_scaling_points(results: dict[str, dict]) -> str:
    """The scaling curve: per point its data, tau on the suite with its interval and per category, then the
    fit and what it extrapolates to, and the plot."""
    data = results["data_scaling"]
    arms, s = data["arms"], data["summary"]
    names = sorted(arms, key=lambda n: arms[n]["budget"]["supervised_tokens"])
    cats = list(arms[names[0]]["result"]["by_category"])
    rows = []
    for name in names:
        a = arms[name]
        r = a["result"]
        rows.append(
            [a["budget"]["samples"], num(a["budget"]["supervised_tokens"], 0), f"**{num(r['acceptance_length'], 3)}**"]
            + [interval(r["ci95"])]
            + [num(r["by_category"][c], 2) for c in cats]
            + [
                num(r.get("offline_heldout_acceptance_length"), 3),
                num(a["cpu_s_data"] + a["cpu_s_train_export_evaluate"], 0),
            ]
        )
    head = ["samples", "supervised tokens", "tau (suite)", "95% interval", *cats, "offline held-out tau", "CPU s"]
    out = [table(head, rows)]
    if "fit_intercept" in s:
        gain = (
            f"{num(s['tau_gain_per_doubling'], 3)} "
            f"{interval([s['tau_gain_per_doubling_ci95_low'], s['tau_gain_per_doubling_ci95_high']])}"
        )
        line = [f"Fit `{data['fit']['model']}`: +{gain} tau per doubling of the data (R² {num(s['fit_r2'], 2)})."]
        for target in ("2_3", "3_0"):
            key = f"samples_for_tau_{target}"
            if key in s:
                high = s.get(f"{key}_ci95_high")
                band = f"[{_count(s[key + '_ci95_low'])}, {_count(high) if high else '∞'}]"
                line.append(
                    f"tau {target.replace('_', '.')} would take ~{_count(s[key])} samples {band} "
                    f"({num(s[f'doublings_beyond_largest_for_tau_{target}'], 1)} doublings beyond the largest point)."
                )
        out += ["", " ".join(line)]
    out += ["", f"![tau against supervised tokens]({Path(data['plot']).relative_to('benchmarks')})"]
    return "\n".join(out)
