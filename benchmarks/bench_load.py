"""Load under faults: 50k prompts at concurrency 1024 against a server that fails 5% of attempts.

    .venv/bin/python benchmarks/bench_load.py            # full: 50,000 prompts, ~10 min here
    .venv/bin/python benchmarks/bench_load.py --quick    # 5,000 prompts, a smoke run

The claim: 0 prompts lost, 0 duplicated, client memory flat. Exits non-zero when
lost or duplicated is not 0. Results: benchmarks/results/load.json, through
benchmarks/results_file.py; ``summary`` holds lost, duplicated, mismatched, the RSS peak ratio and
the wall time over the server's ideal.

No A/A pair: the claims are counts (exact, not noisy) and a within-run memory ratio, and a second
pass would double a ~10-minute run. The wall time has no repeat inside one run; two runs of the same
seed took 627 s and 619 s (1.3% apart).

What runs, and why this way:
- The product's generation path: prepare writes 8 prompt shards, then the client process runs
  `eagle3.generate.shard.generate_shard` per shard with its own `EndpointPool`, split and bounded
  exactly as flows/generate.py does (`generation.concurrency` 1024 split over
  `generation.shard_parallelism` shards). shard_parallelism is 8 so all 8 shards (128 requests
  each) run together and 1024 requests stay in flight until the tail; with the default 2 the run
  would be 4 waves, each ending in a thin tail.
- Shards left incomplete (prompts that failed with transient errors on every attempt) are run
  again, as the Prefect task retry does (`generation.shard_retries` more passes, without its
  15 s delay). Each pass is reported.
- `generation.max_attempts` is 3, not the default 5: at 5% faults per attempt, 5 attempts leave
  ~0.02 expected exhausted prompts in 50k and the resume pass would never run; 3 leave ~6, so
  the second pass is exercised.
- The server is tests/fake_openai/ in its own process (its own GIL), with `slots` = 1024
  (vLLM's --max-num-seqs = the client's concurrency) and 5% of attempts faulted, evenly over
  hang, 429 (Retry-After: 1), 5xx (500/502/503/504; 503 with Retry-After: 1) and TCP reset.
  Faults are drawn per (prompt, attempt), so a retry draws again.
- Speed: Little's law fixes the time a request spends in flight at concurrency / throughput
  whatever the server's speed: at 1024 in flight and ~100 req/s (what one client core does here
  with room for the other agents on this 2-core box; 50k / 100 = ~8 min) every request takes
  ~10 s. So the request deadline cannot be "a few seconds": it is 30 s, and the server's
  latency is shaped so no healthy request comes near it: a fixed 4 s (ttft_s) plus completion
  lengths of median 64 tokens, sigma 0.5, cut at max_tokens 128, at a per-slot speed that makes
  the server's ideal 100 req/s. The longest healthy request is then ~16 s; only injected hangs
  reach 30 s. Each hang costs its worker 30 s: ~600 hangs x 30 s / 1024 workers ~ 20 s of wall.
- Client RSS is sampled every 2 s from /proc/PID/status by this driver, together with the
  server's completed count, so memory can be read against progress. "Flat": the peak RSS after
  the first 20% of requests is less than 10% above the RSS at the 20% mark.
- Lost and duplicated are read from disk after the client exits: every input id must be in
  exactly one of ok / filtered / (finally) failed, and no id may have two ok/filtered records.
  1,000 ok records are also checked token for token against what the server sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import results_file  # noqa: E402
from fake_openai import FakeConfig, completion_for, run_fake_server  # noqa: E402

N = 50_000
SHARDS = 8
CONCURRENCY = 1024
SHARD_PARALLELISM = 8
TARGET_RPS = 100
MAX_TOKENS = 128
MEDIAN_TOKENS = 64
LENGTH_SIGMA = 0.5
TTFT_S = 4.0
REQUEST_TIMEOUT_S = 30.0
MAX_ATTEMPTS = 3
SHARD_RETRIES = 2
FAULT_RATE = 0.05
FAULT_MIX = {"hang": 0.25, "429": 0.25, "5xx": 0.25, "reset": 0.25}
RETRY_AFTER_S = 1.0
SAMPLE_EVERY_S = 2.0
FLAT_LIMIT = 1.10


def _prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"load prompt {i}: describe case {i % 89} and its exceptions"}] for i in range(n)
    ]


def _sets(run_dir: Path) -> list[str]:
    """The run's settings over the demo recipe (`--set` items; bench_orchestrator_load.py passes them to the CLI)."""
    return [
        f'run_dir="{run_dir}"',
        f'data.source="{run_dir / "prompts.jsonl"}"',
        f"data.num_shards={SHARDS}",
        f"generation.max_tokens={MAX_TOKENS}",
        f"generation.concurrency={CONCURRENCY}",
        f"generation.shard_parallelism={SHARD_PARALLELISM}",
        f"generation.request_timeout_s={REQUEST_TIMEOUT_S}",
        f"generation.max_attempts={MAX_ATTEMPTS}",
        f"generation.shard_retries={SHARD_RETRIES}",
        'server.mode="external"',
        'server.model="fake-target"',
    ]


def _config(run_dir: Path):
    from eagle3.config import DEMO_RECIPE, load_config

    return load_config(DEMO_RECIPE, _sets(run_dir))


def _fake(n: int) -> FakeConfig:
    """The fake server: 1024 slots, ideal ~TARGET_RPS for these prompts (see the module docstring)."""
    probe = FakeConfig(median_tokens=MEDIAN_TOKENS, length_sigma=LENGTH_SIGMA)
    tokens = sum(len(completion_for(probe, m, MAX_TOKENS)[1].token_ids) for m in _prompts(n))
    slot_seconds = CONCURRENCY * n / TARGET_RPS
    per_slot = tokens / (slot_seconds - n * TTFT_S)
    return FakeConfig(
        slots=CONCURRENCY,
        tokens_per_s=per_slot,
        ttft_s=TTFT_S,
        median_tokens=MEDIAN_TOKENS,
        length_sigma=LENGTH_SIGMA,
        fault_rate=FAULT_RATE,
        fault_mix=dict(FAULT_MIX),
        fault_retry_after=RETRY_AFTER_S,
    )


# ----------------------------------------------------------------------------- the client process


async def _pass(url: str, config, shards: list[Path]) -> list[dict]:
    """One pass over `shards`, split and bounded as flows/generate.py does."""
    from eagle3.generate.shard import generate_shard, paths
    from eagle3.generate.stage import out_dir
    from eagle3.serving.client import EndpointPool, deadline_s

    gen = config.generation
    parallel = min(gen.shard_parallelism, len(shards))
    per_shard = max(1, gen.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)

    async def one(shard: Path) -> dict:
        async with limit:
            # as tasks/generate.py builds it (external mode: outage_wait_s is server.outage_wait_s)
            pool = EndpointPool([url], None, per_shard, deadline_s(gen), outage_wait_s=config.server.outage_wait_s)
            try:
                r = await generate_shard(shard, out_dir(config), gen, "fake-target", pool, concurrency=per_shard)
            finally:
                await pool.close()
        marker = json.loads(paths(out_dir(config), shard.name)["done"].read_text())
        return {
            "shard": shard.name,
            "in": r.in_,
            "ok": r.ok,
            "failed": r.failed,
            "filtered": r.filtered,
            "retryable": r.retryable,
            "errors": r.errors,
            "retries": marker["retries"],
            "complete": r.complete,
            "sent": marker["stats"]["total"] - marker["stats"]["skipped"],
        }

    return await asyncio.gather(*(one(s) for s in shards))


def client_main(url: str, run_dir: Path) -> None:
    """Pass 1 over every shard, then up to SHARD_RETRIES resume passes over the incomplete ones."""
    from eagle3.run_facts import RunFacts

    config = _config(run_dir)
    todo = list(RunFacts.resolve(config).prompt_shards())
    passes = []
    for number in range(1, 2 + config.generation.shard_retries):
        started = time.perf_counter()
        rows = asyncio.run(_pass(url, config, todo))
        passes.append({"pass": number, "wall_s": time.perf_counter() - started, "shards": rows})
        todo = [Path(config.run_dir) / "prompts" / r["shard"] for r in rows if not r["complete"]]
        if not todo:
            break
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"passes": passes, "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024}))


# ----------------------------------------------------------------------------- driver


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _drive(server, run_dir: Path) -> tuple[dict, list[dict]]:
    """Run the client process; sample its RSS and the server's progress until it exits."""
    cmd = [sys.executable, __file__, "--client", "--url", server.base_url, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    samples, started = [], time.monotonic()
    while proc.poll() is None:
        rss = _rss_mb(proc.pid)
        s = server.stats(attempts=False)
        if rss is not None:
            samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "rss_mb": round(rss, 1),
                    "server_completed": s["completed"],
                    "server_requests": s["requests_total"],
                    "in_flight": s["in_flight"],
                }
            )
        try:
            proc.wait(SAMPLE_EVERY_S)
        except subprocess.TimeoutExpired:
            pass
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"client failed (exit {proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1]), samples


def _ids_per_stream(path: Path) -> Counter:
    counts: Counter = Counter()
    if path.exists():
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                counts[json.loads(line)["id"]] += 1
    return counts


def audit(run_dir: Path, fake: FakeConfig, check: int = 1000, seed: int = 0) -> dict:
    """Read the run back from disk: per shard and in total, ok / filtered / failed, lost, duplicated,
    and `check` ok records compared token for token with what the server sends for their prompt."""
    import pyarrow.parquet as pq

    from eagle3.generate.shard import paths

    gen_dir = run_dir / "generations"
    per_shard, lost, duplicated, finals_failed = {}, [], [], 0
    attempts: Counter = Counter()
    failure_kinds: Counter = Counter()
    messages_of, ok_records = {}, []
    for shard in sorted((run_dir / "prompts").glob("shard-*.parquet")):
        table = pq.read_table(shard, columns=["id", "messages"])
        ids = table.column("id").to_pylist()
        messages_of.update(zip(ids, table.column("messages").to_pylist()))
        p = paths(gen_dir, shard.name)
        ok, filtered, failed = (_ids_per_stream(p[k]) for k in ("ok", "filtered", "failed"))
        done = ok + filtered
        duplicated += [i for i, n in done.items() if n > 1]
        failed_final = set(failed) - set(done)
        lost += [i for i in ids if i not in done and i not in failed_final]
        finals_failed += len(failed_final)
        if p["failed"].exists():
            with open(p["failed"], encoding="utf-8") as fh:
                failure_kinds.update(json.loads(line)["error_kind"] for line in fh)
        per_shard[shard.name] = {
            "in": len(ids),
            "ok": len(ok),
            "filtered": len(filtered),
            "failed": len(failed_final),
            "failure_records": sum(failed.values()),
            "unknown_ids": len((set(done) | set(failed)) - set(ids)),
        }
        with open(p["ok"], encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                attempts[r["attempts"]] += 1
                ok_records.append(r)
    mismatched = []
    for r in random.Random(seed).sample(ok_records, min(check, len(ok_records))):
        prompt_ids, comp = completion_for(fake, messages_of[r["id"]], r["sampling"]["max_tokens"])
        if (
            r["prompt_token_ids"] != prompt_ids
            or r["completion_token_ids"] != comp.token_ids
            or r["finish_reason"] != comp.finish_reason
        ):
            mismatched.append(r["id"])
    total = {k: sum(s[k] for s in per_shard.values()) for k in ("in", "ok", "filtered", "failed", "unknown_ids")}
    return {
        "shards": per_shard,
        "total": total,
        "failure_records_by_kind": dict(failure_kinds),
        "lost": len(lost),
        "lost_ids": lost[:10],
        "duplicated": len(duplicated),
        "duplicated_ids": duplicated[:10],
        "ok_attempts_histogram": {str(k): v for k, v in sorted(attempts.items())},
        "checked_against_server": min(check, len(ok_records)),
        "mismatched": len(mismatched),
    }


def _flatness(samples: list[dict], n: int) -> dict:
    mark = next((k for k, s in enumerate(samples) if s["server_completed"] >= 0.2 * n), None)
    if mark is None or not samples:
        return {"flat": None, "reason": "too few samples"}
    at_mark = samples[mark]["rss_mb"]
    after = [s["rss_mb"] for s in samples[mark:]]
    peak_ratio, end_ratio = max(after) / at_mark, after[-1] / at_mark
    return {
        "rss_at_20pct_mb": at_mark,
        "rss_end_mb": after[-1],
        "peak_after_20pct_mb": max(after),
        "peak_ratio": round(peak_ratio, 4),
        "end_ratio": round(end_ratio, 4),
        "limit": FLAT_LIMIT,
        "flat": peak_ratio < FLAT_LIMIT,
    }


def run(n: int, out_path: Path, keep: bool) -> int:
    import eagle3.generate.shard  # noqa: F401 -- everything the audit needs, imported before the long run
    from eagle3.prepare.stage import run_prepare

    run_dir = Path(tempfile.mkdtemp(prefix="eagle3-load-"))
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in _prompts(n)))
    prepared = run_prepare(_config(run_dir))
    fake = _fake(n)
    started = time.perf_counter()
    with run_fake_server(fake, in_thread=False) as server:
        client, samples = _drive(server, run_dir)
        stats = server.stats(attempts=False)
    wall = time.perf_counter() - started
    (run_dir / "client-and-server.json").write_text(json.dumps({"client": client, "samples": samples, "server": stats}))
    disk = audit(run_dir, fake)
    retries: Counter = Counter()
    for p in client["passes"]:
        for row in p["shards"]:
            retries.update(row["retries"])
    result = {
        "n": n,
        "shards": len(prepared.shards),
        "concurrency": CONCURRENCY,
        "shard_parallelism": SHARD_PARALLELISM,
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "max_attempts": MAX_ATTEMPTS,
        "max_tokens": MAX_TOKENS,
        "fake": {
            "fault_rate": FAULT_RATE,
            "fault_mix": FAULT_MIX,
            "retry_after_s": RETRY_AFTER_S,
            "slots": fake.slots,
            "tokens_per_s_per_slot": round(fake.tokens_per_s, 3),
            "ttft_s": TTFT_S,
            "median_tokens": MEDIAN_TOKENS,
            "length_sigma": LENGTH_SIGMA,
            "ideal_wall_s": round(n / TARGET_RPS, 1),
        },
        "wall_s": round(wall, 1),
        "client_cpu_s": round(client["cpu_s"], 1),
        "client_maxrss_mb": round(client["maxrss_mb"], 1),
        "server": {
            "requests": stats["requests_total"],
            "completed": stats["completed"],
            "faults": stats["faults"],
            "faults_total": sum(stats["faults"].values()),
            "fault_fraction": round(sum(stats["faults"].values()) / max(1, stats["requests_total"]), 4),
            "max_in_flight": stats["max_in_flight"],
            "busy_slot_seconds": round(stats["busy_slot_seconds"], 1),
        },
        "passes": client["passes"],
        "retries": dict(retries),
        "retries_total": sum(retries.values()),
        "failure_records_by_kind": disk["failure_records_by_kind"],
        # attempts the client gave up on at the deadline that were not injected hangs: healthy requests
        # that spent longer than the deadline in flight (client event loop starved on the shared box)
        "timeouts_beyond_hangs": retries["timeout"]
        + disk["failure_records_by_kind"].get("timeout", 0)
        - stats["faults"].get("hang", 0),
        **{
            k: disk[k]
            for k in (
                "total",
                "lost",
                "duplicated",
                "lost_ids",
                "duplicated_ids",
                "ok_attempts_histogram",
                "checked_against_server",
                "mismatched",
            )
        },
        "per_shard_on_disk": disk["shards"],
        # every record the server completed is on disk once, except answers to attempts the client had
        # already given up on
        "server_completed_minus_records": stats["completed"] - disk["total"]["ok"] - disk["total"]["filtered"],
        "rss": {"every_s": SAMPLE_EVERY_S, **_flatness(samples, n), "samples": samples},
        "run_dir": str(run_dir) if keep else None,
    }
    headline = {
        "lost": disk["lost"],
        "duplicated": disk["duplicated"],
        "mismatched": disk["mismatched"],
        "wall_vs_ideal": round(wall / (n / TARGET_RPS), 4),
    }
    if result["rss"].get("peak_ratio") is not None:  # absent when the run was too short to sample
        headline["rss_peak_ratio"] = result["rss"]["peak_ratio"]
    results_file.write(out_path, "load", headline, **result)
    print(summary(result))
    if not keep:
        import shutil

        shutil.rmtree(run_dir)
    accounted = disk["total"]["in"] == disk["total"]["ok"] + disk["total"]["filtered"] + disk["total"]["failed"] == n
    problems = [f"lost={disk['lost']}"] if disk["lost"] else []
    problems += [f"duplicated={disk['duplicated']}"] if disk["duplicated"] else []
    problems += [] if accounted else [f"accounting does not add up: {disk['total']} for {n} prompts"]
    problems += [f"{disk['mismatched']} records differ from what the server sent"] if disk["mismatched"] else []
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


def summary(r: dict) -> str:
    t, rss = r["total"], r["rss"]
    lines = [
        (
            f"{r['n']} prompts in {r['shards']} shards at concurrency {r['concurrency']}: wall {r['wall_s']} s "
            f"(server ideal {r['fake']['ideal_wall_s']} s)"
        ),
        (
            f"server: {r['server']['requests']} requests, {r['server']['faults_total']} faults injected "
            f"{r['server']['faults']}"
        ),
        f"client retries: {r['retries_total']} {r['retries']}; failure records {r['failure_records_by_kind']}; "
        f"timeouts beyond the injected hangs: {r['timeouts_beyond_hangs']}",
    ]
    for p in r["passes"]:
        s = {k: sum(x[k] for x in p["shards"]) for k in ("sent", "ok", "filtered", "failed", "retryable")}
        lines.append(
            f"pass {p['pass']}: {len(p['shards'])} shards, {s['sent']} prompts sent; those shards then: ok "
            f"{s['ok']} filtered {s['filtered']} failed {s['failed']} (retryable {s['retryable']}); "
            f"{p['wall_s']:.1f} s"
        )
    lines.append(
        f"on disk: in {t['in']} = ok {t['ok']} + filtered {t['filtered']} + failed {t['failed']}; lost "
        f"{r['lost']}, duplicated {r['duplicated']}, {r['mismatched']} of {r['checked_against_server']} checked "
        "records differ from the server's"
    )
    lines.append(
        f"client RSS: {rss.get('rss_at_20pct_mb')} MB at 20% of requests, peak after "
        f"{rss.get('peak_after_20pct_mb')} MB (ratio {rss.get('peak_ratio')}, flat={rss.get('flat')}), "
        f"{rss.get('rss_end_mb')} MB at the end"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5,000 prompts")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--out", default=None)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args.url, Path(args.run_dir))
    n = args.n or (5_000 if args.quick else N)
    default = ROOT / "benchmarks" / "results" / ("load.json" if n == N else f"load-{n}.json")
    sys.exit(run(n, Path(args.out) if args.out else default, args.keep))


if __name__ == "__main__":
    main()
