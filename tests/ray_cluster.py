"""A real Ray cluster on loopback for the scale-out tests: a head and one more worker node, each a
``ray start --block`` in its own process group (two raylets on one machine are two Ray nodes), on
free ports and in a temp dir of its own, so nothing else on the machine is touched.

    with LocalCluster(tmp_path) as cluster:
        config = ... f'cluster.address="{cluster.address}"'
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import ROOT

RAY = ROOT / ".venv" / "bin" / "ray"


# The GCS declares a node dead after this many failed health checks this far apart. With Ray's
# defaults (3 s x 5) a SIGKILLed raylet was declared dead 14 s later, and the task that ran there was
# retried only then (Ray 2.60, measured here); its refused connection fails each check at once, so
# 1 s x 3 declares it in ~3 s, while a raylet that is merely slow keeps each check's 10 s timeout.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """``nodes`` Ray nodes on 127.0.0.1 (the first is the head), each with ``cpus`` logical CPUs and a
    custom resource ``node<i>`` so a test can place work on a chosen node; ``quick_node_death``: the
    GCS declares a killed node dead in ~3 s (HEALTH_CHECKS)."""

    def __init__(
        self,
        log_dir: Path,
        nodes: int = 2,
        cpus: int = 1,
        start_timeout_s: float = 120.0,
        quick_node_death: bool = False,
    ):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray's unix sockets need a short path; a fresh folder under /tmp keeps clusters apart.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
        if quick_node_death:  # for the tests that kill a node; the others keep Ray's own settings
            self.env.update(HEALTH_CHECKS)
        self.procs: list[subprocess.Popen] = []
        try:
            for i in range(nodes):
                self._start(i, cpus)
                self.wait_for(i + 1, start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, i: int, cpus: int) -> None:
        common = [
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps({f'node{i}': 1})}",
            "--disable-usage-stats",
        ]
        if i == 0:
            argv = [
                RAY,
                "start",
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}",
                f"--temp-dir={self.temp_dir}",
                *common,
            ]
        else:
            argv = [RAY, "start", f"--address={self.address}", *common]
        log = open(self.log_dir / f"ray-node{i}.log", "w")
        self.procs.append(
            subprocess.Popen(
                argv, env=self.env, cwd=self.temp_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()

    def alive_nodes(self) -> int:
        out = subprocess.run(
            [
                str(ROOT / ".venv" / "bin" / "python"),
                "-c",
                "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))",
                self.address,
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0

    def wait_for(self, nodes: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    log = (self.log_dir / f"ray-node{i}.log").read_text()
                    raise AssertionError(f"ray node {i} exited: {log[-3000:]}")
            if self.alive_nodes() >= nodes:
                return
            time.sleep(1.0)
        raise AssertionError(f"the local Ray cluster did not reach {nodes} live nodes in {timeout_s:.0f} s")

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL node ``i`` as a machine that vanishes: its ``ray start`` group (the raylet and its
        agents) and every process below it in one sweep. Ray starts each worker in a session of its
        own, so the group alone would leave the workers (and what they started: torchrun) running,
        still answering calls. Returns the pids killed."""
        root = self.procs[i]
        doomed = [root.pid, *_descendants(root.pid)]
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _kill_group(root, grace_s=0.0)
        return doomed

    def node_pids(self, i: int) -> set[int]:
        """Node ``i``'s processes: its ``ray start``, the raylet and agents, the workers and theirs."""
        return {self.procs[i].pid, *_descendants(self.procs[i].pid)}

    def stop(self) -> None:
        for p in reversed(self.procs):
            _kill_group(p, grace_s=5.0)
        subprocess.run(["rm", "-rf", str(self.temp_dir)], check=False)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` in the process tree, whatever its group or session."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parent = int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM and a short wait (Ray's own shutdown is slow and not needed here), then SIGKILL the
    whole group: the launcher may be gone while its raylet and workers linger in it."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if wait <= 0:
            continue
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
