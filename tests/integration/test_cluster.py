"""The tokenize and extract shard tasks on a real Ray cluster (a head and a second node on loopback,
tests/ray_cluster.py), through the stage flows and a real Prefect server: the outputs are
byte-identical to the single-machine run's, a worker SIGKILLed in the middle of a shard is rerun by
Ray with nothing lost or duplicated, a whole node SIGKILLed mid-shard is counted lost and the rerun
completes it byte-identical, and a run without an address never imports Ray. The node kill comes
last: the node stays down (bringing it back would cost the suite ~15 s)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from ray_cluster import LocalCluster

from conftest import PYTHON, ROOT
from procs import ours

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_kills import make_inputs, outputs  # noqa: E402

pytestmark = pytest.mark.integration

# Small batches: many per shard, so a worker can be killed with part of its shard written (the
# batch size is part of the arithmetic, so every run here uses the same one).
SETS = ['extract.dtype="float32"', "extract.batch_tokens=64", "vocab.draft_vocab_size=1000"]

# The three stages as flows, in a process of their own; it says whether Ray was imported.
LOCAL_RUN = """
import sys
from eagle3.config import DEMO_RECIPE, load_config
from flows.extract import extract_flow
from flows.tokenize import tokenize_flow
from flows.vocab import vocab_flow
config = load_config(DEMO_RECIPE, [f'run_dir="{sys.argv[1]}"', *sys.argv[2:]])
tokenize_flow(config)
vocab_flow(config)
extract_flow(config)
print("ray imported:", "ray" in sys.modules, "prefect_ray imported:", "prefect_ray" in sys.modules, flush=True)
"""


def api_env() -> dict:
    """The environment that sends a subprocess's flows to the suite's Prefect test server."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1"}


def worker_running(title: str) -> int | None:
    """The pid of this test worker's Ray worker whose title has ``title`` (Ray titles a worker
    ``ray::<task name>`` while it runs)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if args.startswith("ray::") and title in args and ours(pid):
            return int(pid)
    return None


class KillMidShard(threading.Thread):
    """SIGKILL the Ray worker running ``extract-shard-00001`` once its hidden temp output exists:
    the shard is under way, part of its states written."""

    def __init__(self, run: Path):
        super().__init__(daemon=True)
        self.run_dir, self.killed, self.partial_at_kill = run, None, None
        self.stop = threading.Event()

    def partial(self) -> list[str]:
        folder = self.run_dir / "hidden_states"
        return [p.name for p in folder.glob(".shard-00001*")] if folder.exists() else []

    def run(self) -> None:
        while not self.stop.is_set():
            pid = worker_running("extract-shard-00001")
            if pid is not None and self.partial():
                self.partial_at_kill = self.partial()
                os.kill(pid, signal.SIGKILL)
                self.killed = pid
                return
            time.sleep(0.005)


class KillNodeMidShard(threading.Thread):
    """SIGKILL the whole of cluster node 1 once an extraction shard that runs there has part of its
    states written (its hidden temp output exists); ``killed`` is then that shard's name."""

    def __init__(self, run: Path, cluster: LocalCluster):
        super().__init__(daemon=True)
        self.run_dir, self.cluster, self.killed = run, cluster, None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for shard in ("shard-00000", "shard-00001"):
                pid = worker_running(f"extract-{shard}")
                folder = self.run_dir / "hidden_states"
                if pid is None or not folder.exists() or not list(folder.glob(f".{shard}*")):
                    continue
                if pid in self.cluster.node_pids(1):
                    self.cluster.kill_node(1)
                    self.killed = shard
                    return
            time.sleep(0.01)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One two-node loopback cluster for the module (it takes ~15 s to start); the driver leaves after each test."""
    with LocalCluster(tmp_path_factory.mktemp("ray-logs"), nodes=2, cpus=1, quick_node_death=True) as local:
        yield local


@pytest.fixture()
def driver():
    import ray

    yield
    ray.shutdown()


def test_generation_shards_on_the_cluster_keep_their_retries_and_key_out_of_sight(
    prefect_server, cluster, driver, demo_config, tmp_path, monkeypatch
):
    import asyncio
    import secrets

    import secret_scan
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    from fake_openai import FakeConfig, FaultRule, run_fake_server
    from flows.generate import generate_flow
    from test_flows import external, task_runs_of

    # The key reaches the tasks on the cluster (the fake server refuses requests without it), and
    # Prefect's shard retry works there as on one machine: "please retry me" fails 3 times, its
    # shard's first attempt gives up after max_attempts=2, the retry resends only that prompt.
    key = f"scan-{secrets.token_hex(16)}"
    monkeypatch.setenv("EAGLE3_API_KEY", key)
    rule = FaultRule(match="please retry me", kind="status", status=503, times=3)
    with run_fake_server(FakeConfig(api_key=key, rules=[rule])) as fake:
        config = external(
            demo_config, tmp_path, fake.base_url, f'cluster.address="{cluster.address}"', 'cluster.stages=["generate"]'
        )
        state = asyncio.run(generate_flow(config, return_state=True))
        assert state.is_completed(), state
        attempts = fake.stats()["attempts"]
    assert attempts["please retry me"] == 4
    assert all(n == 1 for p, n in attempts.items() if p != "please retry me"), "finished prompts are never resent"
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = {t.name.rsplit("-", 1)[0]: t.run_count for t in task_runs_of(client, flow_run_id)}
        logs = [entry.message for entry in client.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]}))]
    assert any("generate: 2 shard task(s) on the Ray cluster at " + cluster.address in m for m in logs), logs
    assert sorted(r for r in runs if r.startswith("generate-shard")) == ["generate-shard-00000", "generate-shard-00001"]
    runs = {r: n for r, n in runs.items() if r.startswith("generate-shard")}
    assert sorted(runs.values()) == [1, 2], runs
    manifest = json.loads((Path(config.run_dir) / "manifest.json").read_text())["stages"]["generate"]
    assert (manifest["in"], manifest["ok"], manifest["failed"]) == (20, 20, 0)

    # ... and nowhere else: not in Ray's job, actor, task or worker records (a runtime_env is there), not in
    # the environment of any process of the cluster's nodes, not in what the Prefect API holds for the flow
    # run (its parameters, task runs, logs, artifacts), not in the run folder nor in Ray's logs.
    assert secret_scan.ray_metadata(cluster.address, key) == []
    assert secret_scan.process_environments([p.pid for p in cluster.procs], key) == []
    assert secret_scan.prefect_records(flow_run_id, key) == []
    assert secret_scan.files([Path(config.run_dir), cluster.temp_dir, cluster.log_dir], key) == []


@pytest.mark.timeout(900)
def test_shard_tasks_on_a_ray_cluster_match_one_machine_and_survive_a_killed_worker_and_a_lost_node(
    prefect_server, cluster, driver, tmp_path
):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.manifest import read_manifest
    from flows.extract import extract_flow
    from flows.tokenize import tokenize_flow
    from flows.vocab import vocab_flow

    # The single-machine reference, through the same flows, in a process that reports on Ray.
    local = tmp_path / "local"
    make_inputs(local)
    out = subprocess.run(
        [PYTHON, "-c", LOCAL_RUN, str(local), *SETS],
        cwd=ROOT,
        env=api_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ray imported: False prefect_ray imported: False" in out.stdout, out.stdout[-2000:]
    reference = outputs(local)

    cluster_sets = [*SETS, f'cluster.address="{cluster.address}"', "cluster.extract_gpus=0"]
    # Clean run on the cluster: byte-identical outputs.
    clean = tmp_path / "on-ray"
    make_inputs(clean)
    config = load_config(DEMO_RECIPE, [f'run_dir="{clean}"', *cluster_sets])
    tokenize_flow(config)
    vocab_flow(config)
    extract_flow(config)
    assert outputs(clean) == reference

    # A worker SIGKILLed mid-shard: Ray reruns the task, the shard resumes, nothing lost or duplicated.
    killed = tmp_path / "killed"
    make_inputs(killed)
    config = load_config(DEMO_RECIPE, [f'run_dir="{killed}"', *cluster_sets])
    tokenize_flow(config)
    vocab_flow(config)
    killer = KillMidShard(killed)
    killer.start()
    try:
        extract_flow(config)
    finally:
        killer.stop.set()
        killer.join(timeout=10)
    assert killer.killed is not None, "the extraction finished before a worker could be killed mid-shard"
    assert killer.partial_at_kill, "the kill came before the shard had written anything"
    assert outputs(killed) == reference
    entry = read_manifest(killed)["stages"]["extract"]
    assert entry["in"] == entry["ok"] == 400 and entry["failed"] == 0, entry
    assert not list((killed / "hidden_states").glob(".*")), "a temp file was left behind"
    states = json.loads((killed / "hidden_states" / "shard-00001.index.json").read_text())
    rows = pq.read_table(killed / "tokenized" / "shard-00001.parquet", columns=["id"]).column("id").to_pylist()
    assert states["ids"] == rows and len(set(rows)) == len(rows)

    # A whole node lost mid-shard (cluster node 1: its raylet and every worker, SIGKILLed at once), with no
    # Ray retry left (cluster.task_max_retries=0): the stage waits for the other shard, counts the lost one
    # and fails with ShardLost naming it; the rerun redoes only that shard, byte-identical. The inputs are the
    # run's above (byte-identical to the reference); its states are extracted again.
    from flows.cluster import ShardLost

    shutil.rmtree(killed / "hidden_states")
    no_retry = load_config(DEMO_RECIPE, [f'run_dir="{killed}"', *cluster_sets, "cluster.task_max_retries=0"])
    killer = KillNodeMidShard(killed, cluster)
    killer.start()
    try:
        with pytest.raises(ShardLost) as lost:
            extract_flow(no_retry)
    finally:
        killer.stop.set()
        killer.join(timeout=10)
    assert killer.killed is not None, "the extraction finished before node 1 could be killed mid-shard"
    shard = killer.killed
    said = str(lost.value)
    assert said.startswith("extract: 1 of 2 shard task(s) lost on the cluster, 1 finished and on disk"), said
    assert f"extract-{shard}: its Ray worker or node died 1 time(s) (cluster.task_max_retries=0)" in said, said
    assert "(NodeDiedError: Task failed because the node it was running on is dead" in said, said
    other = "shard-00000" if shard == "shard-00001" else "shard-00001"
    assert (killed / "hidden_states" / f"{other}.done.json").exists(), "the other shard finished"
    assert not (killed / "hidden_states" / f"{shard}.done.json").exists()
    extract_flow(config)  # the rerun, on the node left
    assert outputs(killed) == reference
    entry = read_manifest(killed)["stages"]["extract"]
    assert entry["in"] == entry["ok"] == 400 and entry["failed"] == 0, entry
    assert not list((killed / "hidden_states").glob(".*")), "a temp file was left behind"
    for name in ("shard-00000", "shard-00001"):
        states = json.loads((killed / "hidden_states" / f"{name}.index.json").read_text())
        rows = pq.read_table(killed / "tokenized" / f"{name}.parquet", columns=["id"]).column("id").to_pylist()
        assert states["ids"] == rows and len(set(rows)) == len(rows)
