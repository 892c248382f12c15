"""Orchestrator loss (docs/faults.md#orchestrator-loss): the Prefect server is SIGKILLed while a generation
shard is mid-way and started again on the same port and database.

`eagle3 generate` runs as a user runs it, against a real `prefect server start` of its own (its own port,
home and SQLite: the suite's shared server must not be killed), and against the fault-injecting fake
target slowed to ~1 s a request, so the shard is still writing when the server dies. The decision under
test: a server back within the client's retry window (cli/prefect_client.py) is ridden out. The flow run
ends Completed, the shard task ran once, every prompt was sent once and is on disk once; the rerun sends
nothing and ends Completed with the same records. Past the window the run stops with one line and the
rerun resumes: that half runs with no window at all (PREFECT_CLIENT_MAX_RETRIES=0), so it costs seconds.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import DEMO_RECIPE, PYTHON, ROOT
from fake_openai import FakeConfig, run_fake_server
from prefect_server import Server

pytestmark = pytest.mark.integration

PROMPTS = 16
# 4 requests at a time, ~1.2 s each (48 tokens at 40 tokens/s): the shard takes ~5 s, long enough to kill the
# server with part of it on disk and short enough for the suite.
FAKE = FakeConfig(slots=4, tokens_per_s=40.0, median_tokens=48, length_sigma=0.3)


def _sets(run: Path, src: Path, url: str) -> list[str]:
    return [
        f'run_dir="{run}"',
        f'data.source="{src}"',
        "data.num_shards=1",
        'server.mode="external"',
        'server.model="fake-target"',
        f'server.urls=["{url}"]',
        "generation.concurrency=4",
    ]


def _prepare(tmp_path: Path, name: str, url: str) -> tuple[Path, list[str]]:
    """Prompts prepared in this process (prepare is not under test); the `eagle3 generate` arguments."""
    from eagle3.config import load_config
    from eagle3.prepare.stage import run_prepare

    src = tmp_path / f"{name}.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{name} question {i}"}]}) + "\n"
            for i in range(PROMPTS)
        )
    )
    run = tmp_path / name
    sets = _sets(run, src, url)
    run_prepare(load_config(DEMO_RECIPE, sets))
    argv = [PYTHON, "-m", "cli", "generate", "--config", str(DEMO_RECIPE), "--progress", "off"]
    for s in sets:
        argv += ["--set", s]
    return run, argv


def _start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _records(run: Path) -> int:
    return sum(f.read_bytes().count(b"\n") for f in (run / "generations").glob("shard-?????*.jsonl"))


def _wait_records(run: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 120
    while _records(run) < n:
        assert proc.poll() is None, f"eagle3 generate ended (exit {proc.returncode}) before {n} records"
        assert time.monotonic() < deadline, f"fewer than {n} records in 120 s"
        time.sleep(0.05)


def _ids(run: Path, pattern: str) -> list[str]:
    return [
        json.loads(line)["id"]
        for f in sorted((run / "generations").glob(pattern))
        for line in f.read_text().splitlines()
    ]


def _prepared(run: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [
        i for f in sorted((run / "prompts").glob("shard-*.parquet")) for i in pq.read_table(f).column("id").to_pylist()
    ]


def _exactly_once(run: Path) -> dict:
    """Every prepared id once in ok or filtered, none failed, and the manifest's in == ok + failed + filtered."""
    entry = json.loads((run / "manifest.json").read_text())["stages"]["generate"]
    finished = _ids(run, "shard-?????.jsonl") + _ids(run, "shard-?????.filtered.jsonl")
    assert len(finished) == len(set(finished)), "a prompt was written twice"
    assert sorted(finished) == sorted(_prepared(run)), "a prompt is missing"
    assert entry["in"] == entry["ok"] + entry["failed"] + entry["filtered"] == PROMPTS
    assert entry["failed"] == 0 and entry["ok"] + entry["filtered"] == len(finished)
    return entry


def _files(run: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted((run / "generations").glob("shard-*.jsonl"))}


@pytest.mark.timeout(600)
def test_a_prefect_server_killed_mid_shard_and_restarted_is_ridden_out_and_a_longer_loss_stops_and_resumes(tmp_path):
    server = Server(tmp_path / "prefect")
    env = {k: v for k, v in server.env.items() if not k.startswith("PREFECT_CLIENT_")}  # the command's own window
    env["PREFECT_LOGGING_LEVEL"] = "WARNING"
    try:
        with run_fake_server(FAKE) as fake:
            # Within the window: SIGKILL with a third of the shard on disk; the shard ends while the server is
            # down, so the flow has to wait for it; then the server starts again (~10 s down here).
            run, argv = _prepare(tmp_path, "ridden", fake.base_url)
            proc = _start(argv, env, tmp_path / "ridden.log")
            _wait_records(run, proc, PROMPTS // 3)
            server.kill()
            killed_at, on_disk = time.monotonic(), _records(run)
            done = run / "generations" / "shard-00000.done.json"
            while not done.exists():
                assert proc.poll() is None and time.monotonic() - killed_at < 60, "the shard did not end"
                time.sleep(0.05)
            server.start()
            down_s = time.monotonic() - killed_at
            assert on_disk < PROMPTS and proc.poll() is None, "the shard was mid-way and the run waited for the server"
            assert proc.wait(timeout=300) == 0, (tmp_path / "ridden.log").read_text()[-4000:]
            entry = _exactly_once(run)
            attempts = fake.stats()["attempts"]
            assert len(attempts) == PROMPTS and set(attempts.values()) == {1}, "a prompt was sent twice"
            (first,) = server.flow_runs("eagle3-generate")
            assert first["state_type"] == "COMPLETED", first["state"]
            (shard,) = server.task_runs(first["id"], "generate-shard")
            assert shard["run_count"] == 1, "the shard task was not retried: nothing was redone"
            assert shard["state_type"] == "COMPLETED", "its end, sent while the server was down, reached it later"
            records = _files(run)

            # The rerun (the next trigger): nothing to do, nothing sent, the same records, Completed.
            rerun = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert rerun.returncode == 0, rerun.stderr[-4000:]
            assert _files(run) == records and fake.stats()["attempts"] == attempts
            counts = ("in", "ok", "failed", "filtered")
            assert [_exactly_once(run)[k] for k in counts] == [entry[k] for k in counts]
            assert [r["state_type"] for r in server.flow_runs("eagle3-generate")] == ["COMPLETED", "COMPLETED"]

            # Past the window (none here): the run stops with one line naming the server; the rerun resumes.
            run, argv = _prepare(tmp_path, "stopped", fake.base_url)
            short = {**env, "PREFECT_CLIENT_MAX_RETRIES": "0"}
            proc = _start(argv, short, tmp_path / "stopped.log")
            _wait_records(run, proc, PROMPTS // 3)
            server.kill()
            log = tmp_path / "stopped.log"
            while not (lines := [s for s in log.read_text().splitlines() if s.startswith("eagle3 generate")]):
                assert proc.poll() is None, log.read_text()[-4000:]
                time.sleep(0.05)
            (line,) = lines
            assert line.startswith(f"eagle3 generate: error: lost the Prefect server at PREFECT_API_URL={server.api} (")
            assert "run the same command again" in line
            assert _records(run) == PROMPTS, "the shard finished its work without the server"
            # Back now, so the exit does not spend ~7 s on each event Prefect could not send (docs/faults.md).
            server.start()
            assert proc.wait(timeout=300) == 1
            again = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert again.returncode == 0, again.stderr[-4000:]
            _exactly_once(run)
            sent = {p: n for p, n in fake.stats()["attempts"].items() if p.startswith("stopped")}
            assert len(sent) == PROMPTS and set(sent.values()) == {1}, "the rerun sent only what was not on disk"
            # The stopped run could not record its end: it stays Running in the server's records (docs/faults.md).
            assert [r["state_type"] for r in server.flow_runs("eagle3-generate")][2:] == ["RUNNING", "COMPLETED"]
    finally:
        server.stop()
    print(f"server down {down_s:.1f} s with {on_disk} of {PROMPTS} records on disk")
