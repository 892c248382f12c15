"""``[cluster]`` without a cluster: the settings' checks, the deadline on reaching a head, the waits for
a lost node (over a stand-in node table), and no Ray import anywhere unless an address is set
(tests/integration/test_cluster.py runs a real cluster)."""

import subprocess
import threading
import time

import pytest

from conftest import PYTHON, ROOT
from eagle3.config import ConfigError, load_config
from eagle3.config.base import DEMO_RECIPE

# Every module of the product imported, and the demo config's branch decisions taken.
IMPORT_ALL = """
import importlib, pkgutil, sys
# cli.__main__ runs the CLI on import; the vLLM modules run inside vLLM's own environment.
skip = ("cli.__main__", "eagle3.extract.vllm_worker", "eagle3.extract.vllm_connector")
for package in ("eagle3", "flows", "tasks", "cli"):
    module = importlib.import_module(package)
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if info.name not in skip:
            importlib.import_module(info.name)
from eagle3.config import DEMO_RECIPE, load_config
config = load_config(DEMO_RECIPE)
assert not any(config.cluster.runs(s) for s in ("generate", "tokenize", "extract", "train"))
print(sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "prefect_ray"))))
"""


def test_nothing_imports_ray_without_a_cluster_address():
    out = subprocess.run([PYTHON, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def config_with(*sets):
    return load_config(DEMO_RECIPE, ['run_dir="runs/t"', *sets])


def test_an_address_places_only_the_listed_stages():
    c = config_with('cluster.address="10.0.0.5:6379"', 'cluster.stages=["extract"]').cluster
    assert c.runs("extract") and not c.runs("tokenize") and not c.runs("train")
    assert not config_with('cluster.stages=["extract"]').cluster.runs("extract")  # no address: nothing placed


@pytest.mark.parametrize(
    "address, says",
    [("auto", "never starts a Ray instance"), ("headnode", "needs a port"), ("ray://head", "needs a port")],
)
def test_bad_addresses_are_refused_naming_the_key(address, says):
    with pytest.raises(ConfigError, match="cluster.address") as err:
        config_with(f'cluster.address="{address}"')
    assert says in str(err.value)


def test_managed_replicas_run_on_this_machine_without_a_cluster_address(monkeypatch):
    """Without an address the replicas are local processes (eagle3/serving/local_replicas.py): the
    config takes them, and the run's start does not look for a Ray head."""
    import eagle3.cluster as cluster

    probed = []
    monkeypatch.setattr(cluster, "probe", lambda address, timeout_s: probed.append(address))
    local = config_with("server.replicas=2")
    assert local.server.replicas == 2 and not local.cluster.address
    cluster.precheck(local, ["generate"])
    assert probed == [], "no head to probe"
    on_ray = config_with("server.replicas=2", 'cluster.address="head:6379"')
    assert on_ray.server.replicas == 2
    cluster.precheck(on_ray, ["generate"])
    assert probed == ["head:6379"], "replicas on a cluster need its head"


def test_an_absent_head_fails_within_the_deadline_naming_the_address():
    from ray_cluster import free_port

    from eagle3.cluster import ClusterUnreachable, connect
    from eagle3.errors import is_permanent

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    cluster = config_with(f'cluster.address="{address}"', "cluster.connect_timeout_s=1.5").cluster
    started = time.monotonic()
    with pytest.raises(ClusterUnreachable) as err:
        connect(cluster)
    assert 1.4 < time.monotonic() - started < 10
    assert address in str(err.value) and "connect_timeout_s=1.5" in str(err.value)
    assert not is_permanent(err.value)  # a head that is restarting may answer a retry


def test_the_cli_refuses_an_unreachable_head_before_any_stage_runs(tmp_path, prefect_api):
    from ray_cluster import free_port

    from test_cli import run

    address = f"127.0.0.1:{free_port()}"
    sets = [f'run_dir="{tmp_path / "run"}"', f'cluster.address="{address}"', "cluster.connect_timeout_s=1"]
    api = {"PREFECT_API_URL": prefect_api}  # the session's server: no temporary one started per command
    started = time.monotonic()
    result = run("run", "--config", str(DEMO_RECIPE), *[x for s in sets for x in ("--set", s)], env=api)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"cluster.address '{address}': no Ray head answered" in result.stderr
    assert not (tmp_path / "run").exists(), "nothing ran"
    assert time.monotonic() - started < 60
    # A stage that does not use the cluster does not need it.
    prepare = run("prepare", "--config", str(DEMO_RECIPE), *[x for s in sets for x in ("--set", s)], env=api)
    assert prepare.returncode == 0 and "no Ray head answered" not in prepare.stderr, prepare.stderr[-2000:]


class FakeRay:
    """The few calls the lost-node waits make, over a node table a test changes as it goes: ``ready``
    are the refs whose tasks have ended, ``nodes`` what ``ray.nodes()`` answers."""

    def __init__(self, nodes: list[dict]):
        self.nodes_now, self.ready, self.cancelled = nodes, set(), []

    def nodes(self) -> list[dict]:
        return self.nodes_now

    def wait(self, refs, num_returns, timeout):
        time.sleep(timeout)
        return [r for r in refs if r in self.ready], [r for r in refs if r not in self.ready]

    def cancel(self, ref, force):
        self.cancelled.append((ref, force))

    def available_resources(self) -> dict:
        return {}


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    dead = {} if alive else {"DeathReasonMessage": "health check failed due to missing too many heartbeats"}
    return {"NodeID": node_id, "Alive": alive, "Resources": resources if alive else {}, **dead}


def test_shard_tasks_no_live_node_can_run_are_cancelled_after_the_node_wait_and_returned():
    """After the only GPU node is lost Ray would queue its shard's retry forever: the wait gives up on it
    once no live node has held one task's resources for node_wait_s in a row, and only then."""
    from eagle3.cluster import wait_for_tasks

    ray = FakeRay([node("cpu", CPU=4), node("gpu", CPU=4, GPU=1)])
    ray.ready.add("a")
    ended = []
    flap = threading.Timer(0.25, lambda: setattr(ray, "nodes_now", [node("cpu", CPU=4), node("gpu", alive=False)]))
    flap.start()
    started = time.monotonic()
    gave_up = wait_for_tasks(ray, ["a", "b"], {"CPU": 1, "GPU": 1}, wait_s=0.5, on_done=ended.append, poll_s=0.05)
    assert gave_up == {1} and ended == [0] and ray.cancelled == [("b", True)]
    assert 0.75 <= time.monotonic() - started < 5, "the clock starts when the node is gone, not before"
    # A node that comes back within the wait resets the clock, and the task ends by itself.
    ray.cancelled.clear()
    back = threading.Timer(0.3, lambda: setattr(ray, "nodes_now", [node("gpu2", CPU=4, GPU=1)]))
    done = threading.Timer(0.9, lambda: ray.ready.add("b"))
    back.start(), done.start()
    assert wait_for_tasks(ray, ["b"], {"CPU": 1, "GPU": 1}, wait_s=0.5, poll_s=0.05) == set()
    assert ray.cancelled == []


def two_node_run(tmp_path, node_wait_s: float):
    """A 2-node training config and the node record of its last attempt (nodes aaaa0000ff and bbbb1111ff)."""
    config = config_with(
        'cluster.address="head:6379"',
        "cluster.train_gpus_per_process=0",
        f"cluster.node_wait_s={node_wait_s}",
        "train.nnodes=2",
    )
    nodes_file = tmp_path / "cluster_nodes.json"
    nodes_file.write_text(
        '{"nodes": [{"node": 0, "node_id": "aaaa0000ff", "ip": "10.0.0.1"}, '
        '{"node": 1, "node_id": "bbbb1111ff", "ip": "10.0.0.2"}]}'
    )
    return config, nodes_file


def test_a_training_retry_waits_for_its_lost_node_then_names_it_and_the_ways_on(tmp_path, monkeypatch):
    import logging

    from eagle3.cluster import train as cluster_train
    from eagle3.errors import TrainFailed, is_permanent

    monkeypatch.setattr(cluster_train, "NODE_POLL_S", 0.05)
    config, nodes_file = two_node_run(tmp_path, node_wait_s=0.3)
    log = logging.getLogger("test")
    ray = FakeRay([node("aaaa0000ff", CPU=1), node("bbbb1111ff", alive=False)])
    started = time.monotonic()
    with pytest.raises(TrainFailed) as err:
        cluster_train._wait_for_lost_nodes(ray, config, nodes_file, log)
    assert 0.3 <= time.monotonic() - started < 5
    said = str(err.value)
    assert said.startswith(
        "train: train.nnodes=2 needs 2 nodes with {CPU: 1} and the cluster has 1: node 1 (Ray node bbbb1111 at "
        "10.0.0.2: health check failed due to missing too many heartbeats) of this run's last attempt did not come "
        "back within cluster.node_wait_s=0.3 s. Bring the node back (`ray start --address=head:6379` on its machine)"
    ), said
    assert said.endswith("train.nnodes=1 with train.grad_accum=2 keeps the checkpoint's global batch"), said
    assert not is_permanent(err.value), "the node may be back for the next retry"
    # The node back within the wait: the retry goes on.
    threading.Timer(0.1, lambda: setattr(ray, "nodes_now", [node("aaaa0000ff", CPU=1), node("cccc", CPU=1)])).start()
    cluster_train._wait_for_lost_nodes(
        ray,
        config.model_copy(update={"cluster": config.cluster.model_copy(update={"node_wait_s": 5.0})}),
        nodes_file,
        log,
    )
    # None of the last attempt's nodes gone: no wait (the cluster never had 2; check_resources refuses it).
    ray.nodes_now = [node("aaaa0000ff", CPU=1), node("bbbb1111ff", CPU=0.5)]
    started = time.monotonic()
    cluster_train._wait_for_lost_nodes(ray, config, nodes_file, log)
    assert time.monotonic() - started < 0.1


def test_a_training_retry_before_ray_declares_the_node_dead_looks_again_once_it_has(tmp_path, monkeypatch):
    """Ray counts a lost node alive until its health checks fail, so a quick retry's placement group asks
    for it too and is not granted; by then the node is declared dead, and the retry looks again: it places
    on a spare node, or (none) waits for the lost one and names it."""
    import logging
    import sys
    import types

    from eagle3.cluster import train as cluster_train
    from eagle3.errors import TrainFailed

    monkeypatch.setattr(cluster_train, "NODE_POLL_S", 0.05)
    ray = FakeRay([node("aaaa0000ff", CPU=1), node("bbbb1111ff", CPU=1), node("cccc2222ff", CPU=1)])
    declared = [node("aaaa0000ff", CPU=1), node("bbbb1111ff", alive=False), node("cccc2222ff", CPU=1)]
    asked = []

    class Group:
        def wait(self, timeout_s):
            asked.append(timeout_s)
            if len(asked) == 1:  # the GCS declares the lost node dead while the first group waits
                ray.nodes_now = declared
                return False
            return True

    fake = types.ModuleType("ray.util.placement_group")
    fake.placement_group = lambda bundles, strategy: Group()
    fake.remove_placement_group = lambda group: None
    monkeypatch.setitem(sys.modules, "ray.util.placement_group", fake)
    config, nodes_file = two_node_run(tmp_path, node_wait_s=0.2)
    log = logging.getLogger("test")
    assert isinstance(cluster_train._placement(ray, config, nodes_file, log), Group)
    assert len(asked) == 2, "placed on the spare node at the second look"
    # No spare node: the second look waits for the lost one, then names it.
    asked.clear()
    ray.nodes_now = [node("aaaa0000ff", CPU=1), node("bbbb1111ff", CPU=1)]
    declared = [node("aaaa0000ff", CPU=1), node("bbbb1111ff", alive=False)]
    with pytest.raises(TrainFailed, match=r"node 1 \(Ray node bbbb1111 at 10.0.0.2: .* did not come back"):
        cluster_train._placement(ray, config, nodes_file, log)
    assert len(asked) == 1
