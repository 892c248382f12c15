"""The deployments as a user runs them: a real `prefect server start` (SQLite), `prefect deploy` from
deployments/prefect.yaml, a process worker, and the nightly deployment triggered twice -- the
second night, with no new prompt, sends nothing to the target. Also a Postgres-backed server."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import DEMO_RECIPE, ROOT
from eagle3.config import overlay, read_toml
from prefect_server import VENV, Server, free_port, stop_group

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def flow_run_state(server: Server, flow_run_id: str) -> str:
    return httpx.get(f"{server.api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"]


def trigger(server: Server, params: dict, timeout_s: float = 900) -> str:
    out = server.prefect("deployment", "run", "eagle3-regenerate/nightly-regeneration", "--params", json.dumps(params))
    run_id = next(line.split("UUID:")[1].strip() for line in out.stdout.splitlines() if "UUID:" in line)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = flow_run_state(server, run_id)
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} did not finish in {timeout_s} s")


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")
def test_nightly_deployment_runs_and_a_second_night_generates_nothing_new(tmp_path):
    server = Server(tmp_path / "prefect")
    worker = None
    try:
        server.prefect("work-pool", "create", "eagle3-process", "--type", "process", "--overwrite")
        server.prefect("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        deployments = httpx.post(f"{server.api}/deployments/filter", json={}, timeout=10).json()
        nightly = next(d for d in deployments if d["name"] == "nightly-regeneration")
        schedule = nightly["schedules"][0]["schedule"]
        assert (
            schedule["cron"] == "0 2 * * *"
            and schedule["timezone"] == "Europe/Berlin"
            and nightly["work_pool_name"] == "eagle3-process"
        )
        assert any(d["name"] == "full-pipeline" for d in deployments)

        worker_log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen(
            [VENV / "prefect", "worker", "start", "--pool", "eagle3-process"],
            env=server.env,
            cwd=ROOT,
            stdout=worker_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        run = tmp_path / "nightly"
        params = {
            "config": overlay(
                read_toml(DEMO_RECIPE),
                {"run_dir": str(run), "data": {"limit": 10, "num_shards": 2}, "server": {"python": str(VLLM_PYTHON)}},
            )
        }
        assert trigger(server, params) == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        gen = run / "generations"
        first = {f.name: (f.stat().st_mtime_ns, f.read_text()) for f in sorted(gen.glob("shard-?????.jsonl"))}
        assert sum(len(text.splitlines()) for _, text in first.values()) == 10
        server_log = (gen / "server.log").read_text()

        assert trigger(server, params) == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        second = {f.name: (f.stat().st_mtime_ns, f.read_text()) for f in sorted(gen.glob("shard-?????.jsonl"))}
        assert second == first, "no record was written on the second night"
        assert (gen / "server.log").read_text() == server_log, "no server was started on the second night"
        manifest = json.loads((run / "manifest.json").read_text())["stages"]
        assert manifest["generate"]["ok"] == 10 and manifest["tokenize"]["ok"] == 10
    finally:
        if worker is not None:
            stop_group(worker)
        server.stop()


def sql(port: int, database: str, query: str):
    import asyncio

    import asyncpg

    async def go():
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user="prefect", database=database, timeout=10)
        try:
            return await conn.fetchval(query) if query.lower().startswith("select") else await conn.execute(query)
        finally:
            await conn.close()

    return asyncio.run(go())


def wait_and_create_db(port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            sql(port, "postgres", "CREATE DATABASE prefect")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        except Exception as exc:  # the server is up but still starting ("the database system is starting up")
            if "starting up" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _postgres_bin() -> Path | None:
    for candidate in [shutil.which("initdb"), *sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))]:
        if candidate:
            return Path(candidate).parent
    return None


@pytest.mark.timeout(600)
@pytest.mark.skipif(_postgres_bin() is None, reason="PostgreSQL is not installed (Debian: apt-get install postgresql)")
def test_a_postgres_backed_server_runs_a_flow(tmp_path):
    """The documented multi-worker setup: Prefect's server on PostgreSQL (asyncpg)."""
    import tempfile

    # PostgreSQL refuses to run as root: as root, run it as the postgres user in a folder it owns
    # (pytest's tmp_path sits under a root-only folder).
    as_user = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]
    pg_root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    if as_user:
        shutil.chown(pg_root, "postgres")
    bin_dir, data, port = _postgres_bin(), pg_root / "data", free_port()
    subprocess.run(
        [*as_user, bin_dir / "initdb", "-D", data, "-U", "prefect", "--auth=trust"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pg = subprocess.Popen(
        [*as_user, bin_dir / "postgres", "-D", data, "-p", str(port), "-k", str(pg_root), "-h", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = None
    try:
        wait_and_create_db(port)
        url = f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
        server = Server(tmp_path / "prefect", {"PREFECT_API_DATABASE_CONNECTION_URL": url})
        out = subprocess.run(
            [
                VENV / "python",
                "-c",
                (
                    "from flows.prepare import prepare_flow; from eagle3.config import DEMO_RECIPE, load_config; "
                    f"s = prepare_flow(load_config(DEMO_RECIPE, ['run_dir=\"{tmp_path / 'run'}\"']), "
                    "return_state=True); print(s.type.value)"
                ),
            ],
            env=server.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("COMPLETED"), out.stderr[-3000:]
        runs = httpx.post(f"{server.api}/flow_runs/filter", json={}, timeout=10).json()
        assert [r["state"]["type"] for r in runs] == ["COMPLETED"], "the run is recorded in the Postgres-backed server"
        assert sql(port, "prefect", "select count(*) from flow_run") == 1, "the flow run is a row in PostgreSQL"
    finally:
        if server is not None:
            server.stop()
        os.killpg(pg.pid, signal.SIGTERM)
        pg.wait(timeout=30)
        shutil.rmtree(pg_root, ignore_errors=True)


@pytest.mark.timeout(600)
def test_two_workers_share_one_pool(tmp_path):
    """Scale-out: two workers on the same pool, each running one flow run at a time, split the queue."""
    server = Server(tmp_path / "prefect", {"PREFECT_WORKER_QUERY_SECONDS": "2"})
    workers = []
    try:
        server.prefect("work-pool", "create", "eagle3-process", "--type", "process", "--overwrite")
        server.prefect(
            "--no-prompt", "deploy", "flows/prepare.py:prepare_flow", "--name", "scale-out", "--pool", "eagle3-process"
        )
        for name in ("worker-a", "worker-b"):
            log = open(tmp_path / f"{name}.log", "w")
            workers.append(
                subprocess.Popen(
                    [VENV / "prefect", "worker", "start", "--pool", "eagle3-process", "--name", name, "--limit", "1"],
                    env=server.env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        ids = []
        for k in range(4):
            out = server.prefect(
                "deployment",
                "run",
                "eagle3-prepare/scale-out",
                "--params",
                json.dumps({"config": overlay(read_toml(DEMO_RECIPE), {"run_dir": str(tmp_path / f"run-{k}")})}),
            )
            ids.append(next(line.split("UUID:")[1].strip() for line in out.stdout.splitlines() if "UUID:" in line))
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and any(
            flow_run_state(server, i) not in ("COMPLETED", "FAILED", "CRASHED") for i in ids
        ):
            time.sleep(2)
        assert [flow_run_state(server, i) for i in ids] == ["COMPLETED"] * 4
        # Which worker ran which run: its "Worker 'NAME' submitting flow run 'ID'" line (a worker can also
        # mention a run it lost the race for, so plain id matches are not counted).
        ran = {
            name: {
                i for i in ids if f"Worker '{name}' submitting flow run '{i}'" in (tmp_path / f"{name}.log").read_text()
            }
            for name in ("worker-a", "worker-b")
        }
        assert ran["worker-a"] | ran["worker-b"] == set(ids) and all(ran.values()), ran
        assert all((tmp_path / f"run-{k}" / "prompts" / "done.json").exists() for k in range(4))
    finally:
        for worker in workers:
            stop_group(worker)
        server.stop()
