"""The tables in benchmarks/README.md, generated from the JSON files in benchmarks/results/.

    .venv/bin/python benchmarks/table.py          # rewrite the generated parts of benchmarks/README.md
    .venv/bin/python benchmarks/table.py --check  # exit 1, naming the parts, when the README is stale
    .venv/bin/python benchmarks/table.py --audit  # exit 1, naming the files, when one lacks provenance

A number typed by hand drifts from the run it came from; so each table sits between
``<!-- generated:NAME begin -->`` and ``<!-- generated:NAME end -->`` and is rewritten from the
results files, while the prose around it stays the author's. The summary table reads only each
file's ``summary`` (named numbers, benchmarks/results_file.py) and its provenance; the detailed
tables read the payload of the benchmark they describe. Output depends on the JSON alone (no clock),
so ``--check`` is stable.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
sys.path[:0] = [str(ROOT / "benchmarks")]

from table_format import num, table  # noqa: E402
from table_suite import (  # noqa: E402
    data_scaling_points,
    free_speculator_grid,
    free_speculator_methods,
    sample_efficiency_arms,
)

import results_file  # noqa: E402

# The headline figures of each benchmark, in the order the summary table shows them, with the target
# each must meet (None: reported without one). A key matches a summary name equal to it or starting
# with it and "_" (stage_vs_raw covers stage_vs_raw_short and stage_vs_raw_long). A benchmark with
# no entry, or none of whose names match, shows every figure of its summary that is not an A/A ratio.
TARGETS: dict[str, dict[str, tuple[str, float] | None]] = {
    "real_target": {
        "acceptance_length_trained": (">=", 2.3),
        "speedup_fastest_vs_fastest_none": (">=", 1.5),
        "speedup_vs_fastest_none": (">=", 1.5),
        "speedup_vs_best_free": (">=", 1.15),
        "speedup_vs_ngram": (">=", 1.0),
        "generation_tok_s_two_engines_vs_one": (">=", 1.7),
        "offline_acceptance_length": None,
    },
    "extract": {
        "stage_vs_bare": (">=", 0.85),
        "bytes_vs_min": ("<=", 1.01),
        "tiny_stage_vs_bare": (">=", 0.85),
        "vllm_tiny_stage_vs_bare": (">=", 0.85),
    },
    "fp8": {
        "fp8_acceptance_vs_bf16": (">=", 0.99),
        "fp8_live_acceptance_vs_bf16": (">=", 0.99),
        "fp8_bytes_vs_bf16": ("<=", 0.51),  # half, plus the scales
    },
    "generation": {"client_cpu_per_request_vs_plain": ("<=", 1.2), "max_rps_vs_plain": None},
    "train": {"default_stage_vs_loop": (">=", 0.9), "stage_vs_loop": (">=", 0.9), "peak_rss_gib": None},
    "train_compile": {"compiled_vs_eager": None, "compile_s": None},
    "tokenize": {"stage_vs_raw": (">=", 0.9), "jinja_stage_vs_raw": None},
    "load": {"lost": ("==", 0), "duplicated": ("==", 0), "rss_peak_ratio": ("<", 1.1), "wall_vs_ideal": None},
    "orchestrator_load": {
        "lost": ("==", 0),
        "duplicated": ("==", 0),
        "wall_restart_vs_steady": None,
        "outage_s": None,
    },
    "cluster": {"tokenize_ray_vs_local": (">=", 0.9), "extract_ray_vs_local": (">=", 0.9)},
    "cluster_train": {"cluster_vs_local": None},
    "training_data": {"acceptance_regenerated_vs_single": None, "offline_acceptance_regenerated_vs_single": None},
    "free_speculators": {
        "acceptance_length_ngram_best": None,
        "acceptance_length_ngram_recipe": None,
        "acceptance_length_suffix": None,
        "replay_exact_fraction": None,
        "speedup_best_free_vs_none": None,
    },
    "sample_efficiency": {
        "baseline_acceptance_length": None,
        "best_acceptance_length": (">=", 2.3),
        "best_minus_baseline": None,
    },
    "data_scaling": {
        "tau_at_largest": None,
        "tau_gain_per_doubling": None,
        "samples_for_tau_2_3": None,
        "samples_for_tau_3_0": None,
    },
}
ORDER = list(TARGETS)
OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
}


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """Every results file by its name without .json, in name order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def audit(paths) -> list[str]:
    """One line per results file that lacks what results_file.write records (commit, date, machine,
    command, a valid summary), naming the file: these are the runs to repeat."""
    problems = []
    for path in sorted(paths):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"{Path(path).name}: unreadable ({exc})")
            continue
        missing = results_file.missing_fields(data) if isinstance(data, dict) else ["a JSON object"]
        if missing:
            problems.append(f"{Path(path).name}: lacks {', '.join(missing)}")
    return problems


def is_aa(key: str) -> bool:
    return "aa" in key.split("_")


def headline_keys(benchmark: str, summary: dict) -> list[tuple[str, tuple[str, float] | None]]:
    wanted = TARGETS.get(benchmark, {})
    keys = [(k, t) for name, t in wanted.items() for k in summary if k == name or k.startswith(name + "_")]
    keys = [(k, t) for k, t in keys if not is_aa(k)]
    return keys or [(k, None) for k in summary if not is_aa(k)]


def provenance(data: dict) -> tuple[str, str]:
    commit = data.get("commit")
    short = (commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")) if commit else "not recorded"
    date = data.get("date")
    return short, date[:10] if date else "not recorded"


def summary_table(results: dict[str, dict]) -> str:
    """One row per headline figure; benchmark, A/A noise, commit and date on its first row. A file
    named after another benchmark's run (training_data_single.json: a real_target run) is a part
    of that benchmark and has no row of its own; a benchmark of TARGETS without a file gets a row
    saying so."""
    names = [n for n in results if results[n].get("benchmark", n) == n] + [n for n in ORDER if n not in results]
    names.sort(key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
    rows = []
    for name in names:
        if name in results:
            rows += benchmark_rows(name, results[name])
        else:
            rows.append([f"`{name}`", f"no `results/{name}.json` yet"] + ["-"] * 6)
    return table(["benchmark", "figure", "value", "target", "met", "A/A noise", "commit", "date"], rows)


def benchmark_rows(name: str, data: dict) -> list[list[str]]:
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    commit, date = provenance(data)
    noise = ", ".join(f"`{k}` {num(v)}" for k, v in summary.items() if is_aa(k)) or "-"
    rows = []
    for key, target in headline_keys(name, summary) or [(None, None)]:
        value = summary.get(key) if key else None
        met = "-"
        if target and isinstance(value, (int, float)):
            met = "met" if OPS[target[0]](value, target[1]) else "missed"
        first = not rows
        rows.append(
            [f"`{name}`" if first else "", f"`{key}`" if key else "no summary: rerun", num(value)]
            + [f"{target[0]} {target[1]}" if target else "-", met]
            + ([noise, commit, date] if first else ["", "", ""])
        )
    return rows


def real_target_stages(results: dict[str, dict]) -> str:
    data = results["real_target"]
    rows = [
        [name, num(s.get("wall_s"), 1), s.get("in"), s.get("ok"), s.get("failed"), s.get("filtered")]
        + [s.get("tokens") or "", num(s.get("tokens_per_s"), 1) if s.get("tokens_per_s") else ""]
        for name, s in data["stages"].items()
    ]
    commit, date = provenance(data)
    head = ["stage", "wall s", "in", "ok", "failed", "filtered", "tokens", "tokens/s"]
    total = f"total {num(data.get('total_wall_s'), 1)} s"
    return f"{table(head, rows)}\n\n({total}; commit {commit}, {date}; `results/real_target.json`)"


def real_target_live(results: dict[str, dict]) -> str:
    rows = []
    for c in results["real_target"]["live"]["cells"]:
        greedy = f"{c['greedy_identical']}/{c['greedy_compared']}" if c.get("greedy_compared") else ""
        rows.append(
            [c["prompt_set"], f"{c['temperature']:g}", str(c["concurrency"]), c["method"]]
            + [num(c.get("decode_tokens_per_s"), 1), num(c.get("mean_acceptance_length"), 2)]
            + [num(c.get("speedup_vs_none"), 2), num(c.get("speedup_vs_fastest_none"), 2)]
            + [num(c.get("speedup_vs_best_free"), 2), greedy]
        )
    head = ["prompt set", "T", "c", "method", "decode tok/s", "acceptance length", "vs none (eager)"]
    return table(head + ["vs fastest none", "vs best free", "greedy identical"], rows)


def tokenize_sizes(results: dict[str, dict]) -> str:
    rows = []
    for size, m in results["tokenize"]["sizes"].items():
        t, e = m["template_path"], m["server_ids_path"]
        rows.append(
            [size, "template", t["samples"], t["tokens"] // t["samples"], num(t["stage_samples_per_s"], 0)]
            + [num(t["stage_tokens_per_s"], 0), num(t["raw_tokens_per_s"], 0), f"**{t['ratio']:.2f}**"]
            + [num(t["ratio_jinja"], 2)]
            + [num(t.get("stage_aa"), 2)]
        )
        rows.append([size, "server ids", e["rows"], e["tokens"] // e["rows"], num(e["rows_per_s"], 0)])
        rows[-1] += [num(e["tokens_per_s"], 0)]
        rows[-1] += ["-"] * 4
    head = ["samples", "path", "rows", "mean tokens", "stage samples/s", "stage tokens/s", "raw encode tokens/s"]
    return table(head + ["stage / raw", "stage / raw, all rows by jinja", "stage A/A"], rows)


def cluster_stages(results: dict[str, dict]) -> str:
    data = results["cluster"]
    s, rows = data["summary"], []
    for stage, sec in data["median_seconds"].items():
        rows.append(
            [stage, f"{sec['local']:.2f} / {sec['local_again']:.2f}", f"{sec['ray']:.2f} / {sec['ray_again']:.2f}"]
            + [f"{s[f'{stage}_ray_vs_local']:.2f}, {s[f'{stage}_ray_again_vs_local_again']:.2f}"]
            + [f"{s[f'{stage}_local_aa']:.2f}, {s[f'{stage}_ray_aa']:.2f}", f"+{s[f'{stage}_cold_extra_s']:.1f} s"]
        )
    head = ["stage", "one machine s", "Ray s", "Ray vs one machine (A, B)", "A/A noise (local, Ray)"]
    return table(head + ["first run on the cluster"], rows)


def cluster_train_runs(results: dict[str, dict]) -> str:
    d = results["cluster_train"]
    ratio = d.get("summary", {}).get("cluster_vs_local", d.get("ratio"))
    rows = [
        ["torchrun, 1 machine x 2 processes", d["local_2proc_tokens_per_s"], num(d["local_wall_s"], 1)]
        + [num(d["last_loss_local"], 4), num(d.get("summary", {}).get("local_aa"), 2)],
        ["Ray cluster, 2 nodes x 1 process", f"{num(d['cluster_2nodes_tokens_per_s'])} (**{ratio:.2f}**)"]
        + [num(d["cluster_wall_s"], 1), num(d["last_loss_cluster"], 4)]
        + [num(d.get("summary", {}).get("cluster_aa"), 2)],
    ]
    return table(["run", "training tokens/s", "stage wall s", "last loss", "A/A (run 2 / run 1)"], rows)


def load_run(results: dict[str, dict]) -> str:
    d = results["load"]
    server, passes = d["server"], d["passes"]
    failure_records = sum(d["failure_records_by_kind"].values())

    def one_pass(p: dict) -> str:
        """Pass 1: the shards' ok and failed after it; a resume pass: how many of the prompts it sent
        again ended ok."""
        ok, failed, sent = (sum(s[k] for s in p["shards"]) for k in ("ok", "failed", "sent"))
        if p["pass"] == 1:
            return f"{ok:,} ok, {failed:,} failed, {p['wall_s']:.0f} s"
        return f"{sent - failed:,} of {sent:,} ok, {p['wall_s']:.0f} s"

    rss = d["rss"]
    rows = [
        [server["requests"], f"{server['faults_total']:,} ({server['fault_fraction']:.2%})"]
        + [f"{d['retries_total']:,} + {failure_records:,}", one_pass(passes[0])]
        + [one_pass(passes[1]) if len(passes) > 1 else "-", f"**{d['lost']}**", f"**{d['duplicated']}**"]
        + [f"{rss.get('rss_at_20pct_mb')} / {rss.get('peak_after_20pct_mb')} / {rss.get('rss_end_mb')} MB"]
        + [f"{rss.get('peak_ratio')}x", f"{d['wall_s']:.0f} s / {d['fake']['ideal_wall_s']:.0f} s"]
    ]
    head = ["requests sent", "faults injected", "retries + failure records", "pass 1", "pass 2 (resume)", "lost"]
    return table(head + ["duplicated", "client RSS at 20% / peak after / end", "peak / at 20%", "wall / ideal"], rows)


def training_data_variants(results: dict[str, dict]) -> str:
    """The two runs side by side; stage times and trained tokens from each run's own results file
    (training_data_<variant>.json, a bench_real_target run) where it is there."""
    variants = results["training_data"]["variants"]
    runs = {name: results.get(f"training_data_{name}", {}) for name in variants}
    first = next(iter(variants.values()))

    def row(label: str, cell: Callable[[str, dict], str]) -> list[str]:
        return [label] + [cell(name, v) for name, v in variants.items()]

    def samples(name: str, v: dict) -> str:
        parts = v["data"].get("variants") or {}
        return f"{v['data']['samples']:,}" + (f" ({', '.join(f'{n:,} at {k}' for k, n in parts.items())})")

    def passes(name: str, v: dict) -> str:
        trained = (runs[name].get("offline") or {}).get("train_tokens")
        return f"{trained / v['data']['tokens']:.1f}" if trained and v["data"].get("tokens") else "-"

    def walls(name: str, v: dict) -> str:
        stages = runs[name].get("stages") or {}
        return " / ".join(
            num((stages.get(s) or {}).get("wall_s"), 0) for s in ("generate", "extract", "train", "evaluate")
        )

    def live(t: str) -> Callable[[str, dict], str]:
        def cell(name: str, v: dict) -> str:
            ratio = v[t]["acceptance_length_trained"] / first[t]["acceptance_length_trained"]
            mine = f"**{num(v[t]['acceptance_length_trained'])}**"
            return (
                mine
                + (f" ({ratio:.2f}x)" if v is not first else "")
                + f"; n-gram {num(v[t]['acceptance_length_ngram'], 2)}"
            )

        return cell

    rows = [
        row("samples (generate ok)", samples),
        row(
            "conversations with every earlier answer supervised",
            lambda n, v: num((v["data"].get("history_check") or {}).get("history_supervised")),
        ),
        row("tokens / supervised", lambda n, v: f"{v['data']['tokens']:,} / {v['data']['supervised_tokens']:,}"),
        row("optimizer steps; passes over the data", lambda n, v: f"{v['train_steps']}; {passes(n, v)}"),
        row("stage wall s: generate / extract / train / evaluate", walls),
        row("offline held-out τ (training's estimate)", lambda n, v: num(v["offline_held_out_acceptance"])),
        row("live τ, T = 0", live("t0")),
        row("live τ, T = 0.7", live("t0.7")),
    ]
    return table([""] + list(variants), rows)


def per_key(summary: dict, key: str, suffix: str, digits: int | None = None) -> str:
    return num(summary.get(f"{key}_{suffix}"), digits)


def generation_client(results: dict[str, dict]) -> str:
    """Per concurrency: client CPU per request and req/s, plain script vs pipeline, and the plain A/A."""
    s, rows = results["generation"]["summary"], []
    for c in sorted(int(k.rsplit("_c", 1)[1]) for k in s if k.startswith("client_cpu_per_request_vs_plain_c")):
        rows.append(
            [str(c), per_key(s, "plain_cpu_ms_per_request", f"c{c}", 2)]
            + [per_key(s, "pipeline_cpu_ms_per_request", f"c{c}", 2)]
            + [f"**{per_key(s, 'client_cpu_per_request_vs_plain', f'c{c}', 2)}**"]
            + [per_key(s, "plain_max_rps", f"c{c}", 0), per_key(s, "pipeline_max_rps", f"c{c}", 0)]
            + [per_key(s, "max_rps_vs_plain", f"c{c}", 2), num(s.get(f"aa_c{c}"), 2)]
        )
    head = ["concurrency", "plain CPU ms/req", "pipeline CPU ms/req", "CPU ratio", "plain req/s", "pipeline req/s"]
    return table(head + ["req/s ratio", "A/A (plain CPU)"], rows)


def extract_targets(results: dict[str, dict]) -> str:
    """Per target: stage and bare-forward tokens/s, their ratios (wall and CPU) with A/A, bytes, fp8."""
    s, rows = results["extract"]["summary"], []
    for name in results["extract"]["targets"]:
        rows.append(
            [name]
            + [num(s.get(f"{name}_stage_tokens_per_s"), 0), num(s.get(f"{name}_bare_tokens_per_s"), 0)]
            + [f"**{num(s.get(f'{name}_stage_vs_bare'), 2)}**", num(s.get(f"{name}_aa"), 2)]
            + [num(s.get(f"{name}_stage_vs_bare_cpu"), 2), num(s.get(f"{name}_aa_cpu"), 2)]
            + [num(s.get(f"{name}_bytes_vs_min"), 4), num(s.get(f"{name}_fp8_vs_bf16"), 2)]
        )
    vllm = results["extract"].get("vllm")
    if vllm:  # whole calls, each starting its engine: tokens over the median wall of each side
        walls = {side: sorted(r[side]["wall_s"] for r in vllm["rounds"]) for side in ("stage", "bare")}
        median = {side: w[len(w) // 2] for side, w in walls.items()}
        rows.append(
            ["tiny, vLLM backend"]
            + [num(vllm["tokens"] / median["stage"], 0), num(vllm["tokens"] / median["bare"], 0)]
            + [f"**{num(s.get('vllm_tiny_stage_vs_bare'), 2)}**", num(s.get("vllm_tiny_aa"), 2), "-", "-", "-", "-"]
        )
    head = ["target", "stage tokens/s", "bare tokens/s", "stage / bare", "A/A", "stage / bare (CPU s)"]
    return table(head + ["A/A (CPU s)", "bytes / minimum", "fp8 / bf16 tokens/s"], rows)


def train_configs(results: dict[str, dict]) -> str:
    """Per shape: the trainer vs the minimal loop with the loop's A/A, chunked vs plain loss, peak RSS."""
    s, rows = results["train"]["summary"], []
    for name, cfg in results["train"]["configs"].items():
        rows.append(
            [name, str(cfg.get("draft_vocab", "-")), per_key(s, "stage_vs_loop", name, 2)]
            + [f"**{per_key(s, 'default_stage_vs_loop', name, 2)}**"]
            + [per_key(s, "aa", name, 2), per_key(s, "chunked_vs_plain", name, 2)]
            + [per_key(s, "peak_rss_gib", name, 2), per_key(s, "peak_rss_gib_chunked", name, 2)]
        )
    head = ["shapes", "draft vocab", "trainer / loop, plain loss", "trainer as shipped (chunked) / loop"]
    head += ["A/A (loop twice)", "chunked / plain loss"]
    return table(head + ["peak RSS GiB, plain loss", "peak RSS GiB, chunked"], rows)


def fp8_variants(results: dict[str, dict]) -> str:
    """Per variant: stored bytes, the drafter's offline and live acceptance."""
    rows = []
    for name, v in results["fp8"]["variants"].items():
        live = v.get("live_acceptance") or {}
        rows.append(
            [name, v["storage_dtype"], num(v["bytes"] / 2**20, 1), num(v["seconds"].get("extract"), 1)]
            + [num((v.get("final_eval") or {}).get("acceptance_length"), 4)]
            + [num(live.get("heldout"), 4), num(live.get("external"), 4)]
        )
    head = ["variant", "stored as", "MiB", "extract s", "offline acceptance (held out)", "live, held-out prompts"]
    return table(head + ["live, external prompts"], rows)


def train_compile_cases(results: dict[str, dict]) -> str:
    """Per shape and loss: the cold compile's first step, eager and compiled steps, their ratio, A/A, break-even."""
    rows = []
    for c in results["train_compile"]["cases"]:
        rows.append(
            [c["shape"], c["loss"], num(c["compile_first_step_s"], 1), num(c["eager_s"], 2), num(c["compiled_s"], 2)]
            + [f"**{num(c['compiled_vs_eager'], 2)}**", num(c["aa"], 2), num(c["break_even_steps"]) or "-"]
        )
    head = ["shape", "loss", "first step, compiling (s)", f"eager, {c['steps']} steps (s)", "compiled (s)"]
    return table(head + ["compiled vs eager", "A/A (eager twice)", "break-even steps"], rows)


SECTIONS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "generation": ("generation", generation_client),
    "extract": ("extract", extract_targets),
    "train": ("train", train_configs),
    "train_compile": ("train_compile", train_compile_cases),
    "fp8": ("fp8", fp8_variants),
    "summary": ("", summary_table),
    "real_target_stages": ("real_target", real_target_stages),
    "real_target_live": ("real_target", real_target_live),
    "tokenize": ("tokenize", tokenize_sizes),
    "load": ("load", load_run),
    "cluster": ("cluster", cluster_stages),
    "cluster_train": ("cluster_train", cluster_train_runs),
    "training_data": ("training_data", training_data_variants),
    "free_speculators": ("free_speculators", free_speculator_methods),
    "free_speculators_grid": ("free_speculators", free_speculator_grid),
    "sample_efficiency": ("sample_efficiency", sample_efficiency_arms),
    "data_scaling": ("data_scaling", data_scaling_points),
}


def section(name: str, results: dict[str, dict]) -> str:
    needs, render = SECTIONS[name]
    if needs and needs not in results:
        return f"_No `results/{needs}.json` yet: run `benchmarks/bench_{needs}.py`._"
    return render(results)


def regenerate(text: str, results: dict[str, dict]) -> str:
    """``text`` with every generated part rewritten; a part the text has no markers for is an error."""
    for name in SECTIONS:
        pattern = re.compile(
            rf"(<!-- generated:{name} begin -->\n).*?(\n<!-- generated:{name} end -->)",
            re.DOTALL,
        )
        if not pattern.search(text):
            raise ValueError(f"{README.name}: no '<!-- generated:{name} begin/end -->' markers")
        text = pattern.sub(lambda m: m.group(1) + section(name, results) + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README differs from the JSON")
    parser.add_argument("--audit", action="store_true", help="exit 1 when a results file lacks its provenance")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.audit:
        problems = audit(args.results.glob("*.json"))
        print("\n".join(problems) or f"{args.results}: every file carries its provenance and summary")
        return 1 if problems else 0
    old = args.readme.read_text()
    new = regenerate(old, load_results(args.results))
    if not args.check:
        if new != old:
            args.readme.write_text(new)
        print(f"{args.readme}: {'rewritten' if new != old else 'up to date'}")
        return 0
    if new == old:
        return 0
    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), "README.md", "from results/*.json", lineterm="")
    print("\n".join(diff), file=sys.stderr)
    print(f"{args.readme} is out of date with {args.results}: run benchmarks/table.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
