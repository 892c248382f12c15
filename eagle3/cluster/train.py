"""Training on the Ray cluster: torchrun on ``train.nnodes`` cluster nodes, one trigger.

Ray only places the work; the job itself is today's torchrun job (``eagle3.train.worker`` on every
process, the same checkpoints, resume and ``[rank 0] step N/M`` lines):
- a placement group of ``train.nnodes`` bundles, STRICT_SPREAD (one per node; two raylets on one
  machine are two nodes), each ``nproc_per_node`` times ``cluster.train_{cpus,gpus}_per_process``,
  waited for under ``cluster.connect_timeout_s``;
- one ``NodeRunner`` actor per bundle. Actor 0 reports its node's IP and a free port; every actor
  runs ``torchrun --nnodes=N --node-rank=i --master-addr=IP0 --master-port=PORT`` (torchrun's static
  rendezvous: the pipeline is the one that knows every node) as an ``eagle3.proc`` child group, so
  the group dies with the actor even when the actor is SIGKILLed (its guard sees the lifeline close);
- the driver polls the actors for output lines under a deadline, logs them with the node index and
  hands them to ``on_line``; a node whose torchrun exits non-zero, an actor that dies or stops
  answering, or ``train.timeout_s`` stops every node (the actors' groups, then ``ray.kill``) and
  raises ``TrainFailed`` (transient: the Prefect task's retry resumes from checkpoints/latest.json).
  An actor lost with its node is named by its node index and Ray node: it is checked before the
  other nodes' exit codes, since their torchrun then fails on the broken collective too.
The placement group is removed at the end in every case. Why not Ray Train: docs/stages.md (train).

A lost node, decided: the job never shrinks by itself. Which Ray nodes an attempt ran on is written
to ``train/cluster_nodes.json``; a later attempt that finds fewer live nodes able to hold a bundle
than ``train.nnodes`` while one of those is gone waits ``cluster.node_wait_s`` for the cluster to
have them again, then fails (transient) naming the node and the two ways on: bring it back, or set
``train.nnodes`` to the nodes left with a ``train.grad_accum`` that keeps the checkpoint's global
batch (the worker refuses any other). Shrinking by itself would change the run's arithmetic behind
the user's back; with enough live nodes left (a spare node) the retry simply places on them.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from eagle3.cluster import (
    check_resources,
    connect,
    dead_nodes,
    describe_node,
    enter_workdir,
    fitting_nodes,
    workdir_env,
)
from eagle3.config import PipelineConfig
from eagle3.durable import atomic_write_json
from eagle3.errors import TrainFailed
from eagle3.layout import RunLayout
from eagle3.torchrun import torchrun_env as local_env

# How long one poll of a node may take before the node counts as lost (a live actor answers in
# milliseconds; a raylet that vanished without Ray noticing yet would otherwise hang the driver).
POLL_DEADLINE_S = 60.0
# Between polls: output reaches the log within this, and the driver costs nothing next to training.
POLL_INTERVAL_S = 0.5
# A placed actor's worker process starts (imports, runtime_env) within this, on a loaded node too.
ACTOR_START_S = 120.0
# Stopping a node's torchrun: SIGTERM, this long for its workers to leave, then SIGKILL.
STOP_GRACE_S = 15.0
# Lines a node keeps for the driver between two polls (a driver that falls further behind is told
# how many it missed; the node's full output is in its Ray worker log as well).
BUFFER_LINES = 20000
# Lines quoted per node in the error of a failed job.
TAIL_LINES = 20
# Between two looks at the cluster while a retry waits for a lost node to come back.
NODE_POLL_S = 2.0

log_module = logging.getLogger(__name__)


def bundle(config: PipelineConfig) -> dict[str, float]:
    """One node's share of the job: nproc_per_node processes' CPUs and GPUs (zeros left out: Ray
    refuses a zero resource in a bundle)."""
    n, c = config.train.nproc_per_node, config.cluster
    asked = {"CPU": n * c.train_cpus_per_process, "GPU": n * c.train_gpus_per_process}
    return {k: v for k, v in asked.items() if v > 0}


def node_argv(config: PipelineConfig, request: Path, node: int, master: tuple[str, int]) -> list[str]:
    """torchrun's command line on cluster node ``node`` (argv[0] is replaced by the node's Python)."""
    t = config.train
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={t.nproc_per_node}",
        f"--nnodes={t.nnodes}",
        f"--node-rank={node}",
        f"--master-addr={master[0]}",
        f"--master-port={master[1]}",
        "-m",
        "eagle3.train.worker",
        str(request),
    ]


class NodeRunner:
    """A Ray actor holding one node's torchrun group and its output (``ray.remote`` is applied by
    ``run_on_cluster``, so importing this module never imports Ray)."""

    def __init__(self, node: int) -> None:
        enter_workdir()  # the flow's working directory: a config's relative paths resolve as there
        self.node = node
        self._child = None
        self._lines: collections.deque[str] = collections.deque(maxlen=BUFFER_LINES)
        self._count = 0  # lines seen so far; the buffer holds the last len(_lines) of them
        self._lock = threading.Lock()
        self._stopped = False

    def address(self) -> tuple[str, int]:
        """This node's IP (as Ray knows it, so the other nodes reach it) and a port free right now
        for torchrun's store (node 0 only; the port is closed again before torchrun binds it)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def _keep(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)
            self._count += 1

    def where(self) -> dict:
        """This actor's Ray node: its id and IP (what a lost node's error names)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def start(self, argv: list[str], env: dict[str, str], drop_env: tuple[str, ...] = ()) -> int:
        """Start torchrun in its own group under a guard, with this node's environment less its
        credentials (eagle3/secret_env.py; ``drop_env`` names more) and ``env`` over it; returns its pid."""
        from eagle3 import proc
        from eagle3.secret_env import child_env

        argv = [sys.executable, *argv[1:]]  # this node's interpreter, same image
        self._child = proc.Child(
            argv,
            name=f"torchrun node {self.node}",
            logger=log_module,
            env={**child_env(drop=drop_env), **env},
            cwd=os.getcwd(),
            grace_s=STOP_GRACE_S,
            on_line=self._keep,
            tail_lines=TAIL_LINES,
        ).start()
        return self._child.pid

    def poll(self, after: int) -> dict:
        """Lines numbered from ``after`` on, how many of those the buffer no longer held, and the
        exit code once torchrun has exited and its output is drained (None while it runs)."""
        from eagle3 import proc

        code = self._child.poll()
        if code is not None and not self._stopped:
            self._child.stop(proc.LEFTOVER_GRACE_S)  # leftovers of the group; drains the output
            self._stopped = True
        with self._lock:
            first = self._count - len(self._lines)
            start = max(after, first)
            lines = list(self._lines)[start - first :]
            return {"lines": lines, "next": self._count, "missed": start - after, "code": code}

    def stop(self) -> None:
        """SIGTERM the group, STOP_GRACE_S, SIGKILL (no-op once stopped)."""
        if self._child is not None and not self._stopped:
            self._child.stop()
            self._stopped = True


def _last_nodes(path: Path) -> list[dict]:
    """The nodes the last attempt ran on (``[]`` when none was recorded or the file is unreadable:
    then a short cluster is refused as one that never had the nodes)."""
    try:
        return list(json.loads(path.read_text())["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _wait_for_lost_nodes(ray, config: PipelineConfig, nodes_file: Path, log) -> None:
    """Return once train.nnodes live nodes can hold a bundle. With fewer, and a node of the last
    attempt gone, wait up to cluster.node_wait_s for the cluster to have them again, then raise
    TrainFailed naming the node; with none of its nodes gone, return at once (check_resources then
    refuses a cluster that never had enough)."""
    asked, nodes = bundle(config), config.train.nnodes
    if len(fitting_nodes(ray, asked)) >= nodes:
        return
    last = _last_nodes(nodes_file)
    gone = dead_nodes(ray, [n["node_id"] for n in last])
    if not gone:
        return
    lost = [n for n in last if n["node_id"] in gone]
    names = ", ".join(f"node {n['node']} ({describe_node(n['node_id'], n['ip'])}: {gone[n['node_id']]})" for n in lost)
    wait_s = config.cluster.node_wait_s
    log.warning(
        "train: %s of the last attempt gone; waiting up to cluster.node_wait_s=%g s for %d nodes", names, wait_s, nodes
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if len(fitting_nodes(ray, asked)) >= nodes:
            return
        time.sleep(max(0.0, min(NODE_POLL_S, deadline - time.monotonic())))
    live = len(fitting_nodes(ray, asked))
    if live >= nodes:
        return
    raise TrainFailed(
        f"train: train.nnodes={nodes} needs {nodes} nodes with {_want(asked)} and the cluster has {live}: {names} of "
        f"this run's last attempt did not come back within cluster.node_wait_s={wait_s:g} s. {_ways_on(config, live)}"
    )


def _want(asked: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in asked.items()) + "}"


def _ways_on(config: PipelineConfig, live: int) -> str:
    """What the person can do about a lost node: bring it back, or (nodes left) train on those at the
    checkpoint's global batch."""
    t = config.train
    head = config.cluster.address
    start = f"`ray start --address={head}`" if not head.startswith("ray://") else "`ray start --address=HEAD:PORT`"
    back = f"Bring the node back ({start} on its machine) and rerun: training resumes from its last checkpoint"
    if live < 1:
        return back
    per_step = t.nnodes * t.nproc_per_node * t.grad_accum  # micro-batches per optimizer step
    if per_step % (live * t.nproc_per_node):
        return (
            f"{back}; a resume on fewer nodes must keep the checkpoint's global batch, train.nnodes x "
            f"train.nproc_per_node x train.grad_accum = {per_step}"
        )
    return (
        f"{back}; or resume on the nodes left: train.nnodes={live} with train.grad_accum="
        f"{per_step // (live * t.nproc_per_node)} keeps the checkpoint's global batch"
    )


def _placement(ray, config: PipelineConfig, nodes_file: Path, log):
    """The placement group, ready, or ClusterTooSmall / TrainFailed naming what was asked (after a
    lost node, once the wait for it has ended: _wait_for_lost_nodes)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    asked, nodes = bundle(config), config.train.nnodes
    wait_s = config.cluster.connect_timeout_s
    for look in range(2):
        _wait_for_lost_nodes(ray, config, nodes_file, log)
        check_resources(ray, "train", asked, count=nodes)
        group = placement_group([dict(asked) for _ in range(nodes)], strategy="STRICT_SPREAD")
        if group.wait(wait_s):
            return group
        remove_placement_group(group)
        # Ray counts a lost node alive until its health checks have failed (14 s with its defaults), so a
        # retry sooner than that asked for it as well; declared dead now, the lost-node wait decides.
        last = [n["node_id"] for n in _last_nodes(nodes_file)]
        if look == 0 and last and dead_nodes(ray, last):
            continue
        break
    raise TrainFailed(
        f"train: the cluster did not grant {nodes} node(s) with {_want(asked)} each (one per node, train.nnodes x "
        f"train.nproc_per_node x cluster.train_*_per_process) within cluster.connect_timeout_s={wait_s:g} s; "
        f"free now: {ray.available_resources()}. Other jobs hold them; rerun when they are free"
    )


def run_on_cluster(config: PipelineConfig, request: Path, log, on_line, threads: int) -> None:
    """Run the training job on ``train.nnodes`` cluster nodes to its end (see the module doc).
    ``on_line`` sees every line, prefixed ``[node i]``; TrainFailed names a failed node."""
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = connect(config.cluster)
    started = time.monotonic()
    deadline = started + config.train.timeout_s
    nodes, asked = config.train.nnodes, bundle(config)
    nodes_file = RunLayout.of(config).train_nodes
    group = _placement(ray, config, nodes_file, log)
    remote = ray.remote(NodeRunner)
    actors: list = []
    placed: list[dict] = []  # each node's pid, Ray node id and IP, once started
    tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(nodes)]

    def failed(node: int | None, why: str) -> TrainFailed:
        quoted = "".join(
            f"\n[node {i}] last lines:\n" + "\n".join(tail)
            for i, tail in enumerate(tails)
            if tail and node in (None, i)
        )
        where = f"node {node}: " if node is not None else ""
        return TrainFailed(
            f"train on the cluster: {where}{why}; every node was stopped, rerun to resume from the last checkpoint"
            + quoted
        )

    def get(ref, node: int, what: str, wait_s: float):
        left = deadline - time.monotonic()
        try:
            return ray.get(ref, timeout=max(0.1, min(wait_s, left)))
        except RayActorError as exc:
            raise failed(node, _lost_actor(ray, placed[node] if node < len(placed) else None, what, exc)) from None
        except GetTimeoutError:
            # The wait was cut to the job's deadline: that deadline is what ran out (ray.get may give
            # up a hair before it, so the clock alone would misname the cause).
            if left <= wait_s or time.monotonic() >= deadline:
                raise failed(None, f"ran past train.timeout_s={config.train.timeout_s:g} s") from None
            raise failed(node, f"its actor did not answer within {wait_s:g} s while {what}") from None

    try:
        env = {**workdir_env(os.getcwd())}
        for i in range(nodes):
            actors.append(
                remote.options(
                    num_cpus=asked.get("CPU", 0),
                    num_gpus=asked.get("GPU", 0),
                    max_restarts=0,
                    max_task_retries=0,
                    runtime_env=env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                ).remote(i)
            )
        master = get(actors[0].address.remote(), 0, "starting", ACTOR_START_S)
        torch_env = torchrun_env(threads)
        for i, a in enumerate(actors):
            placed.append(get(a.where.remote(), i, "starting", ACTOR_START_S))
            argv = node_argv(config, request, i, master)
            ref = a.start.remote(argv, torch_env, (config.server.api_key_env,))
            placed[i]["pid"] = get(ref, i, "starting", ACTOR_START_S)
        atomic_write_json(
            nodes_file, {"nodes": [{"node": i, "node_id": p["node_id"], "ip": p["ip"]} for i, p in enumerate(placed)]}
        )
        log.info(
            "train: torchrun on %d cluster nodes (master %s:%d, pids %s; %s)",
            nodes,
            *master,
            [p["pid"] for p in placed],
            ", ".join(describe_node(p["node_id"], p["ip"]) for p in placed),
        )
        cursors, codes = [0] * nodes, [None] * nodes
        while True:
            if time.monotonic() >= deadline:
                raise failed(None, f"ran past train.timeout_s={config.train.timeout_s:g} s")
            running = [i for i in range(nodes) if codes[i] is None]
            refs = {i: actors[i].poll.remote(cursors[i]) for i in running}
            lost: list[TrainFailed] = []
            for i, ref in refs.items():
                try:
                    got = get(ref, i, "training", POLL_DEADLINE_S)
                except TrainFailed as exc:
                    lost.append(exc)  # the other nodes' last lines still come in first
                    continue
                if got["missed"]:
                    log.warning("[node %d] %d output lines not shown (the driver fell behind)", i, got["missed"])
                for line in got["lines"]:
                    tails[i].append(line)
                    log.info("[node %d] %s", i, line)
                    if on_line is not None:
                        try:
                            on_line(f"[node {i}] {line}")
                        except Exception as exc:  # noqa: BLE001 - a display hook never stops training
                            log.warning("train: output handler failed: %s", exc)
                cursors[i], codes[i] = got["next"], got["code"]
            if lost:  # a lost node is the cause; the others' torchrun then fails on the broken collective
                raise lost[0]
            bad = [i for i in range(nodes) if codes[i] not in (None, 0)]
            if bad:
                others = "".join(f"; node {i} exited with code {codes[i]}" for i in bad[1:])
                raise failed(bad[0], f"torchrun exited with code {codes[bad[0]]}{others}")
            if all(c == 0 for c in codes):
                return
            time.sleep(POLL_INTERVAL_S)
    finally:
        _stop_all(ray, actors)
        remove_placement_group(group)


def _lost_actor(ray, where: dict | None, what: str, exc: Exception) -> str:
    """Why a node's actor is gone, naming its Ray node, and whether Ray already counts that node dead
    (the GCS says so only after its health checks fail: ~15 s with Ray's defaults)."""
    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if where is None:
        return f"its actor died while {what} (its Ray node or worker process was lost: {said})"
    node = describe_node(where["node_id"], where["ip"])
    try:
        gone = dead_nodes(ray, [where["node_id"]])
    except Exception as lookup:  # noqa: BLE001 - the cause is named either way
        gone, said = {}, f"{said}; the node table could not be read: {lookup}"
    if gone:
        return (
            f"lost with {node} while {what}: Ray counts that node dead ({gone[where['node_id']]}; its actor: {said}). "
            "A rerun needs train.nnodes live nodes and waits up to cluster.node_wait_s for one to come back"
        )
    return f"its actor on {node} died or cannot be reached while {what} (its node or worker process was lost: {said})"


def torchrun_env(threads: int) -> dict[str, str]:
    """What run_train sets for torchrun on one machine (eagle3.torchrun.torchrun_env), with the
    thread count this side chose: a node's Ray worker has its own OMP_NUM_THREADS (its CPU count),
    which would give each of nproc_per_node processes the whole bundle's cores."""
    return local_env(threads, base={})


def _stop_all(ray, actors: list) -> None:
    """Stop every node's torchrun group (SIGTERM, grace, SIGKILL) under one deadline, then kill the
    actors: an actor that cannot answer dies by ray.kill, and its group's guard stops torchrun."""
    if not actors:
        return
    refs = [a.stop.remote() for a in actors]
    ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 10.0)
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - a dead actor is what we want
            log_module.debug("ray.kill: %s", exc)


__all__ = ["NodeRunner", "bundle", "node_argv", "run_on_cluster"]
