"""A real `prefect server start` for tests that need the server as users run it (UI, deployments)."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from conftest import ROOT

VENV = ROOT / ".venv" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`prefect server start` in its own process group, with its own PREFECT_HOME. ``command``: the
    argv that starts it, given the port (default: `prefect server start` on 127.0.0.1)."""

    def __init__(self, home: Path, extra_env: dict | None = None, command=None):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api,
            "PREFECT_UI_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "EAGLE3_PROJECT_DIR": str(ROOT),
            **(extra_env or {}),
        }
        home.mkdir(parents=True, exist_ok=True)
        self.home, self.command = home, command
        self.log = open(home / "server.log", "a")
        self.start()

    def start(self) -> None:
        """Start the server on its port and wait for /health (again after ``kill``: same port, same database)."""
        argv = [VENV / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            self.command(self.port) if self.command else argv,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("prefect server did not answer /health in 120 s")

    def kill(self) -> None:
        """SIGKILL the server's process group, as a crash or an OOM kill would; ``start`` brings it back."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [VENV / "prefect", *args], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    def stop(self) -> None:
        stop_group(self.proc)
        self.log.close()

    def flow_runs(self, flow: str) -> list[dict]:
        """The runs of the flow named ``flow`` this server knows, oldest first."""
        flows = httpx.post(f"{self.api}/flows/filter", json={"flows": {"name": {"any_": [flow]}}}, timeout=30)
        body = {"flows": {"id": {"any_": [f["id"] for f in flows.json()]}}, "sort": "EXPECTED_START_TIME_ASC"}
        return httpx.post(f"{self.api}/flow_runs/filter", json=body, timeout=30).json()

    def task_runs(self, flow_run_id: str, name_like: str) -> list[dict]:
        """The task runs of one flow run whose names contain ``name_like``."""
        body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "task_runs": {"name": {"like_": name_like}}}
        return httpx.post(f"{self.api}/task_runs/filter", json=body, timeout=30).json()


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process group started with start_new_session: SIGTERM twice (a Prefect worker ignores
    the first), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
            break
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
