"""The Ray cluster that ``[cluster]`` names: reaching it, and the work placed on it.

Ray is the engine; this package holds only what the pipeline adds around it. Prefect stays the
orchestrator: the flows place shard tasks through prefect-ray's task runner (``flows/cluster.py``),
and training (``eagle3.cluster.train``) and the target's replicas (``eagle3.cluster.serve``) are Ray
actors this package starts and stops.

Nothing imports Ray unless a cluster address is set: every function that needs it imports it
inside, and ``tests/unit/test_cluster_config.py`` checks that a whole run without an address leaves
``ray`` out of ``sys.modules``.
"""

from __future__ import annotations

import socket
import time

from eagle3.config import ClusterConfig
from eagle3.errors import TransientError, UserError

NAMESPACE = "eagle3"  # every actor the pipeline names lives here, apart from other users' jobs


class ClusterUnreachable(TransientError, ConnectionError):
    """The head did not answer within cluster.connect_timeout_s (a retry may find it up)."""


class ClusterTooSmall(UserError, RuntimeError):
    """The cluster lacks the resources a stage asks for (names what was asked and what exists)."""


def host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``ray://HOST:PORT`` as (host, port)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host.strip("[]"), int(port)


def probe(address: str, timeout_s: float) -> None:
    """A TCP connect to the head under ``timeout_s``: ray.init's own wait for an absent head is long
    and its error does not name the address, so the deadline is ours."""
    host, port = host_port(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            last = exc
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    raise ClusterUnreachable(
        f"cluster.address {address!r}: no Ray head answered within cluster.connect_timeout_s={timeout_s:g} s "
        f"({last}). Start it (`ray start --head`) or fix the address; empty runs everything on this machine"
    )


def init_kwargs() -> dict:
    """ray.init settings the pipeline uses: its own namespace; task output stays in the Prefect task
    runs and Ray's log files rather than echoing into the flow's terminal a second time."""
    return {"namespace": NAMESPACE, "log_to_driver": False}


def connect(cluster: ClusterConfig):
    """Join the cluster as a driver (idempotent in one process) and return the ``ray`` module."""
    probe(cluster.address, cluster.connect_timeout_s)
    import ray

    if not ray.is_initialized():
        ray.init(address=cluster.address, **init_kwargs())
    return ray


def fitting_nodes(ray, asked: dict[str, float]) -> list[dict]:
    """The live nodes whose total resources hold ``asked`` (one task's or one bundle's): those Ray
    can ever place it on, busy or not."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return [n for n in nodes if all(n["Resources"].get(k, 0.0) >= v for k, v in asked.items() if v > 0)]


def check_resources(ray, stage: str, asked: dict[str, float], count: int = 1) -> None:
    """Refuse at once a request no node of the cluster can ever hold (Ray would queue it forever):
    ``asked`` is one task's or bundle's resources, ``count`` how many must fit at the same time."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = len(fitting_nodes(ray, asked))
    if fits < count:
        have = (
            ", ".join("{" + ", ".join(f"{k}: {n['Resources'].get(k, 0):g}" for k in asked) + "}" for n in nodes)
            or "no live nodes"
        )
        want = ", ".join(f"{k}: {v:g}" for k, v in asked.items())
        raise ClusterTooSmall(
            f"{stage}: needs {count} node(s) with {{{want}}} free, but the cluster's nodes have {have}; add nodes or "
            "lower the cluster.* resources for this stage"
        )


def describe_node(node_id: str, ip: str = "") -> str:
    """A Ray node as the errors name it: its id's first 8 hex digits (what `ray list nodes` shows
    in full) and its address."""
    return f"Ray node {node_id[:8]}" + (f" at {ip}" if ip else "")


def dead_nodes(ray, node_ids: list[str]) -> dict[str, str]:
    """Those of ``node_ids`` the GCS counts dead, with the reason it recorded (a node it no longer
    lists counts as gone too: a restarted head forgets the old cluster's nodes)."""
    table = {n["NodeID"]: n for n in ray.nodes()}
    gone = {}
    for node_id in node_ids:
        node = table.get(node_id)
        if node is None:
            gone[node_id] = "unknown to the cluster's head"
        elif not node.get("Alive"):
            gone[node_id] = node.get("DeathReasonMessage") or "dead"
    return gone


def wait_for_tasks(ray, refs: list, asked: dict[str, float], wait_s: float, on_done=None, poll_s: float = 2.0):
    """Wait until every task of ``refs`` has ended, or give up on those no live node can run.

    Ray queues a task it cannot place for as long as it takes (an autoscaler might add a node), so
    after a lost node a task that only that node could hold (its GPUs, say), or a retry of one that
    ran there, would hold the stage forever. Every ``poll_s`` the live nodes are checked against one
    task's ``asked``; once none has held it for ``wait_s`` in a row, the unfinished tasks are
    cancelled. ``on_done(index)`` sees each task end. Returns the indices cancelled that way."""
    pending = {ref: i for i, ref in enumerate(refs)}
    homeless_since: float | None = None
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll_s)
        for ref in ready:
            index = pending.pop(ref)
            if on_done is not None:
                on_done(index)
        if not pending:
            break
        if fitting_nodes(ray, asked):
            homeless_since = None
            continue
        now = time.monotonic()
        homeless_since = now if homeless_since is None else homeless_since
        if now - homeless_since >= wait_s:
            for ref in pending:
                ray.cancel(ref, force=True)
            return set(pending.values())
    return set()


WORKDIR_ENV = "EAGLE3_WORKDIR"


def workdir_env(cwd: str) -> dict:
    """The runtime_env that carries the flow's working directory to the tasks it places: Ray starts
    workers in the raylet's folder, and a config's relative paths (run_dir, a model folder, a
    prompt file) are taken from the flow's."""
    return {"env_vars": {WORKDIR_ENV: cwd}}


def enter_workdir() -> None:
    """In a task placed on the cluster, move to the flow's working directory (no-op elsewhere)."""
    import os

    target = os.environ.get(WORKDIR_ENV)
    if not target or os.getcwd() == target:
        return
    try:
        os.chdir(target)
    except OSError as exc:
        raise UserError(
            f"this cluster node has no folder {target} (the flow's working directory, {WORKDIR_ENV}): run the flow "
            f"and the Ray nodes from the same image, with the project and run_dir at the same paths ({exc})"
        ) from None


def precheck(config, stage_names) -> None:
    """Before a run starts: when any of ``stage_names`` uses the cluster, its head answers (a TCP
    probe; Ray is not imported), so a wrong address fails in seconds, not after hours of generation."""
    uses = any(config.cluster.runs(name) for name in stage_names)
    managed_replicas = config.server.mode == "managed" and config.server.replicas > 1
    if "generate" in stage_names and managed_replicas and config.cluster.address:  # else they run on this machine
        uses = True
    if uses:
        probe(config.cluster.address, config.cluster.connect_timeout_s)
