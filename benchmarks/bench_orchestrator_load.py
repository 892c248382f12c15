"""The load benchmark through Prefect, with the Prefect server SIGKILLed and restarted mid-run.

    .venv/bin/python benchmarks/bench_orchestrator_load.py            # 50,000 prompts, two runs of ~10 min
    .venv/bin/python benchmarks/bench_orchestrator_load.py --n 5000   # a smoke run

benchmarks/bench_load.py drives the generation code in a process of its own, without Prefect. Here the
same load (its prompts, shards, concurrency 1024, deadlines, attempts and its fault-injecting fake target
with 5% of attempts faulted) goes through the product as a user runs it: `eagle3 generate` against a
real `prefect server start` (own port, home and SQLite), twice, each time against a fresh fake target
so both runs meet the same faults (drawn per prompt and attempt):
- `steady`: nothing happens to the Prefect server;
- `restart`: once 40% of the prompts are answered, the server's process group is SIGKILLed, stays down
  DOWN_S seconds, and is started again on the same port and database. The outage (down plus the
  server's own start) stays inside the client's retry window (cli/prefect_client.py), so by the
  decision in docs/faults.md#orchestrator-loss the run rides it out.

What must hold in both: exit 0, the flow run Completed in the server's records, every prompt on disk
exactly once (bench_load.audit: lost 0, duplicated 0, 1,000 records checked token for token against
the server), in == ok + filtered + failed. The figure of merit: the restart run's wall time over the
steady run's (`wall_restart_vs_steady`), with the outage's length beside it. The two runs are one A/B
in one process, back to back on the same machine; no A/A (bench_load: two 50k runs of one seed took 627
and 619 s, 1.3% apart), so a ratio within a few percent of 1 is no difference.

Results: benchmarks/results/orchestrator_load.json (or orchestrator_load-N.json for another --n).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bench_load  # noqa: E402

import results_file  # noqa: E402
from eagle3.config import DEMO_RECIPE  # noqa: E402
from fake_openai import run_fake_server  # noqa: E402
from prefect_server import Server  # noqa: E402

KILL_AT = 0.4  # the share of prompts answered when the server is killed
DOWN_S = 10.0  # how long it stays down before it is started again (then its own start, ~8-25 s here)
TIMEOUT_S = 3600  # one run's bound: ~10 min expected at 50k


def one_run(name: str, n: int, work: Path, server: Server, restart: bool) -> dict:
    """Prepare n prompts, then `eagle3 generate` on them through ``server``; with ``restart``, the server is
    killed at KILL_AT of the answers and started again DOWN_S later."""
    from eagle3.prepare.stage import run_prepare

    run_dir = work / name
    run_dir.mkdir(parents=True)
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in bench_load._prompts(n)))
    run_prepare(bench_load._config(run_dir))
    fake = bench_load._fake(n)
    env = {k: v for k, v in server.env.items() if not k.startswith("PREFECT_CLIENT_")}  # the command's own window
    env["PREFECT_LOGGING_LEVEL"] = "WARNING"  # as a long run is logged; the shard tasks log every failure
    outage: dict = {}
    with run_fake_server(fake, in_thread=False) as target:
        argv = [sys.executable, "-m", "cli", "generate", "--config", str(DEMO_RECIPE), "--progress", "lines"]
        for s in [*bench_load._sets(run_dir), f'server.urls=["{target.base_url}"]']:
            argv += ["--set", s]
        log = work / f"{name}.log"
        began = time.monotonic()
        with open(log, "w") as sink:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        while proc.poll() is None and time.monotonic() - began < TIMEOUT_S:
            if restart and not outage and target.stats(attempts=False)["completed"] >= KILL_AT * n:
                outage["killed_at_s"] = round(time.monotonic() - began, 1)
                outage["answered_at_kill"] = target.stats(attempts=False)["completed"]
                server.kill()
                time.sleep(DOWN_S)
                server.start()  # returns once /api/health answers
                outage["down_s"] = round(time.monotonic() - began - outage["killed_at_s"], 1)
            time.sleep(1.0)
        if proc.poll() is None:
            proc.kill()
            raise SystemExit(f"{name}: `eagle3 generate` still running after {TIMEOUT_S} s; see {log}")
        wall = time.monotonic() - began
        served = target.stats(attempts=False)
    disk = bench_load.audit(run_dir, fake)
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]["generate"]
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "outage": outage or None,
        "server_requests": served["requests_total"],
        "faults_injected": sum(served["faults"].values()),
        "manifest": {k: manifest[k] for k in ("in", "ok", "failed", "filtered")},
        **{k: disk[k] for k in ("total", "lost", "duplicated", "mismatched", "checked_against_server")},
        "log_tail": log.read_text(errors="replace").splitlines()[-3:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=bench_load.N)
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run folders, logs and the server's home")
    args = parser.parse_args()
    n = args.n
    suffix = "" if n == bench_load.N else f"-{n}"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"orchestrator_load{suffix}.json"
    work = Path(tempfile.mkdtemp(prefix="eagle3-orchestrator-load-"))
    server = Server(work / "prefect")
    try:
        runs = {}
        for name, restart in (("steady", False), ("restart", True)):
            runs[name] = one_run(name, n, work, server, restart)
            print(name, json.dumps({k: v for k, v in runs[name].items() if k != "log_tail"}), flush=True)
        states = server.flow_runs("eagle3-generate")
        for state in states:
            state["shards"] = server.task_runs(state["id"], "generate-shard")
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for run, state in zip(runs.values(), states):
        run["flow_run_state"] = state["state_type"]
        run["shard_task_runs"] = sorted(t["run_count"] for t in state["shards"])
    problems = [
        f"{name}: {what}"
        for name, r in runs.items()
        for what, bad in (
            (f"exit {r['exit']}", r["exit"] != 0),
            (f"flow run {r.get('flow_run_state')}", r.get("flow_run_state") != "COMPLETED"),
            (f"lost {r['lost']}", r["lost"]),
            (f"duplicated {r['duplicated']}", r["duplicated"]),
            (f"{r['mismatched']} records differ from the server's", r["mismatched"]),
            (
                f"accounting {r['total']}",
                r["total"]["in"] != r["total"]["ok"] + r["total"]["filtered"] + r["total"]["failed"]
                or r["total"]["in"] != n,
            ),
        )
        if bad
    ]
    if len(states) != 2:
        problems.append(f"the server holds {len(states)} eagle3-generate flow runs, not 2")
    summary = {
        "lost": sum(r["lost"] for r in runs.values()),
        "duplicated": sum(r["duplicated"] for r in runs.values()),
        "wall_restart_vs_steady": round(runs["restart"]["wall_s"] / runs["steady"]["wall_s"], 4),
        "outage_s": (runs["restart"]["outage"] or {}).get("down_s"),
    }
    results_file.write(
        out,
        "orchestrator_load",
        {k: v for k, v in summary.items() if v is not None},
        n=n,
        kill_at=KILL_AT,
        down_s=DOWN_S,
        load=bench_load._sets(Path("RUN")),
        runs=runs,
        problems=problems,
    )
    print(json.dumps(summary))
    if problems:
        sys.exit("FAILED: " + "; ".join(problems))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
