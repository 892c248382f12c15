"""Training on a real two-node Ray cluster (two raylets on loopback): one run_train starts torchrun on
both nodes (1 process each) and matches 2-process torchrun on one machine step for step; a whole node
SIGKILLed mid-training gives one TrainFailed naming it, leaves no torchrun behind, a retry that needs
the node waits for it under its deadline and says so, and a resume on the node left (at the same
global batch) reaches the same loss curve."""

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
from ray_cluster import LocalCluster

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_train import lines, make_train_run, torchrun  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("ray-logs"), nodes=2, cpus=1, quick_node_death=True) as c:
        try:
            yield c
        finally:
            import ray

            ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The loss curve of plain 2-process torchrun on this machine (gloo, CPU)."""
    local, names = make_train_run(tmp_path_factory.mktemp("local"))
    torchrun(local, names, nproc=2)
    return lines(Path(local.run_dir) / "train" / "log.jsonl")


def on_cluster(tmp_path: Path, cluster: LocalCluster):
    return make_train_run(
        tmp_path,
        f'cluster.address="{cluster.address}"',
        "cluster.train_gpus_per_process=0",
        "cluster.train_cpus_per_process=1",
        "train.nnodes=2",
        "train.nproc_per_node=1",
    )


def assert_same_curve(reference: list[dict], got: list[dict]) -> None:
    assert [x["step"] for x in got] == [x["step"] for x in reference], "no step lost, none duplicated"
    for x, y in zip(reference, got):
        assert abs(x["loss"] - y["loss"]) < 1e-4 * max(1, x["loss"]) and x["tokens"] == y["tokens"], (x, y)


def torchruns(request: Path) -> list[int]:
    """pids of live processes whose command line names this run's request file (torchrun, its workers)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(request).encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


def placement_groups_left() -> list:
    import ray

    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_two_cluster_nodes_train_the_same_curve_as_two_local_processes(tmp_path, cluster, reference):
    from eagle3.run_facts import RunFacts
    from eagle3.train.stage import run_train

    config, names = on_cluster(tmp_path, cluster)
    seen: list[str] = []
    entry = run_train(RunFacts.resolve(config), names, on_line=seen.append)
    got = lines(Path(config.run_dir) / "train" / "log.jsonl")
    assert_same_curve(reference, got)
    assert entry.world_size == 2, entry
    assert any(x.startswith("[node 0] [rank 0] step ") for x in seen), seen[-10:]
    assert any(x.startswith("[node 1] ") for x in seen), "node 1's output streams back too"
    assert not placement_groups_left(), "the placement group is removed"


def test_a_job_past_its_deadline_stops_every_node(tmp_path, cluster):
    from eagle3.errors import TrainFailed
    from eagle3.run_facts import RunFacts
    from eagle3.train.stage import run_train

    config, names = on_cluster(tmp_path, cluster)
    # A job that cannot end in 6 s however fast the machine (the tiny run alone can: seen in CI).
    long_job = {"timeout_s": 6.0, "epochs": 1000, "max_steps": None}
    config = config.model_copy(update={"train": config.train.model_copy(update=long_job)})
    request = Path(config.run_dir) / "train" / "request.json"
    with pytest.raises(TrainFailed, match=r"ran past train.timeout_s=6 s; every node was stopped"):
        run_train(RunFacts.resolve(config), names)
    assert not torchruns(request), "no torchrun keeps training"  # stopped before the error was raised
    assert not placement_groups_left()


def test_more_nodes_than_the_cluster_has_is_refused_naming_both(tmp_path, cluster):
    from eagle3.cluster import ClusterTooSmall
    from eagle3.cluster.train import run_on_cluster
    from eagle3.config import DEMO_RECIPE, load_config

    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'cluster.address="{cluster.address}"',
            "cluster.train_gpus_per_process=0",
            "train.nnodes=3",
        ],
    )
    with pytest.raises(ClusterTooSmall, match=r"train: needs 3 node\(s\) with \{CPU: 1\} free, but .*\{CPU: 1\}"):
        run_on_cluster(config, tmp_path / "request.json", None, None, threads=1)
    assert not placement_groups_left()


# Last in the module: node 1 stays down (bringing it back costs ~15 s of the suite), and what comes
# after a lost node is tested on the node left.
def test_a_lost_node_fails_naming_it_and_the_run_resumes_on_the_node_left_to_the_same_curve(
    tmp_path, cluster, reference
):
    from eagle3.errors import TrainFailed
    from eagle3.run_facts import RunFacts
    from eagle3.train.stage import run_train

    config, names = on_cluster(tmp_path, cluster)
    run = Path(config.run_dir)
    log, latest = run / "train" / "log.jsonl", run / "checkpoints" / "latest.json"
    request = run / "train" / "request.json"
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["entry"] = run_train(RunFacts.resolve(config), names)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (latest.exists() and log.exists() and len(lines(log)) >= 4):
            time.sleep(0.05)
        # Which of the job's nodes Ray placed on cluster node 1 (the head, cluster node 0, must live on).
        there = cluster.node_pids(1)
        ranks = {
            int(m.group(1))
            for p in torchruns(request)
            if p in there and (m := re.search(rb"--node-rank=(\d+)", Path(f"/proc/{p}/cmdline").read_bytes()))
        }
    finally:
        cluster.kill_node(1)  # the whole machine at once: raylet, agents, the actor, torchrun and its worker
        thread.join(120)
    assert not thread.is_alive()
    assert len(ranks) == 1, ranks
    rank = ranks.pop()
    error = outcome.get("error")
    assert isinstance(error, TrainFailed), outcome
    assert re.search(rf"node {rank}: .*Ray node [0-9a-f]{{8}} at [0-9.]+", str(error)), error
    assert "rerun to resume from the last checkpoint" in str(error), error
    assert len(lines(log)) < len(reference), "the kill came before the end"
    deadline = time.monotonic() + 30  # the other node's torchrun is stopped (SIGTERM, grace, SIGKILL)
    while torchruns(request) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not torchruns(request), "no torchrun keeps training"
    assert not placement_groups_left()

    # The retry while that node is gone: it waits cluster.node_wait_s for the node, then names it and the ways on.
    # It starts once Ray counts the node dead (~3 s here): one that comes sooner also asks for the node and
    # looks again after cluster.connect_timeout_s (test_cluster_config.py), 30 s this test need not spend.
    import ray

    deadline = time.monotonic() + 30
    while all(n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    waits = config.model_copy(update={"cluster": config.cluster.model_copy(update={"node_wait_s": 2.0})})
    started = time.monotonic()
    with pytest.raises(TrainFailed) as refused:
        run_train(RunFacts.resolve(waits), names)
    said = str(refused.value)
    assert re.search(
        rf"train.nnodes=2 needs 2 nodes with \{{CPU: 1\}} and the cluster has 1: node {rank} \(Ray node", said
    ), said
    assert "did not come back within cluster.node_wait_s=2 s. Bring the node back (`ray start" in said, said
    assert "train.nnodes=1 with train.grad_accum=2 keeps the checkpoint's global batch" in said, said
    assert 2.0 <= time.monotonic() - started < 30
    assert not placement_groups_left()

    # What it proposes: the node left, 1 process x 2 micro-batches, resumes from the checkpoint to the curve of 2 x 1.
    left = config.model_copy(update={"train": config.train.model_copy(update={"nnodes": 1, "grad_accum": 2})})
    seen: list[str] = []
    run_train(RunFacts.resolve(left), names, on_line=seen.append)
    assert any("[node 0] [rank 0] resumed from" in x for x in seen), seen[:20]
    assert_same_curve(reference, lines(log))
