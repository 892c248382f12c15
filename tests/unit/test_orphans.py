"""Child process groups die with the pipeline process, even when it is SIGKILLed.

Each launcher (managed vLLM server, torchrun, the hidden-state vLLM worker) is driven by a
throwaway parent process whose child is a sleeper that forks a grandchild; the parent is
SIGKILLed and the whole child group must be gone shortly after. The pidfile path is checked
for the case that the guard is killed too.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3 import orphans

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")

# The "server": a python that forks a grandchild into its group, then sleeps.
SLEEPER = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"

DRIVERS = {
    "managed": """
        from eagle3.serving.managed import ManagedServer
        ManagedServer(
            [sys.executable, "-c", SLEEPER], "m", log_path=d / "server.log", startup_timeout_s=300, stop_grace_s=2
        ).start()
    """,
    "torchrun": """
        from eagle3.train.stage import _run_streamed
        _run_streamed(
            [sys.executable, "-c", SLEEPER], 300, logging.getLogger(), cwd=d, threads=1, pidfile=d / "torchrun.pid"
        )
    """,
    "vllm_worker": """
        from eagle3.extract.vllm_backend import run_worker
        run_worker([sys.executable, "-c", SLEEPER], None, 300, logging.getLogger(), pidfile=d / "vllm_worker.pid")
    """,
}
PIDFILES = {"managed": "server.pid", "torchrun": "torchrun.pid", "vllm_worker": "vllm_worker.pid"}


def start_driver(kind: str, folder: Path) -> subprocess.Popen:
    code = (
        f"import logging, sys\nfrom pathlib import Path\nd = Path({str(folder)!r})\nSLEEPER = {SLEEPER!r}\n"
        + textwrap.dedent(DRIVERS[kind])
    )
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def group_of(pidfile: Path) -> int:
    """The child's pgid, once the launcher recorded it and the grandchild is up."""

    def ready():
        if not pidfile.exists():
            return None
        pgid = json.loads(pidfile.read_text())["pgid"]
        return pgid if len(orphans.group_members(pgid)) >= 2 and guard_of(pgid) else None

    return wait_for(ready, 30, f"{pidfile}, a two-process group and its guard")


def guard_of(pgid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            argv = orphans.cmdline(int(entry))
            if len(argv) > 4 and argv[3].endswith("guard.py") and argv[4] == str(pgid):
                return int(entry)
    return None


def gone(pid: int) -> bool:
    stat = orphans._stat(pid)
    return stat is None or stat[0] == "Z"


def kill_driver(driver: subprocess.Popen) -> None:
    os.killpg(driver.pid, signal.SIGKILL)  # the driver's whole group, as a scheduler or terminal would
    driver.wait()


@pytest.mark.parametrize("kind", sorted(DRIVERS))
def test_child_group_dies_with_a_sigkilled_parent(kind, tmp_path):
    driver = start_driver(kind, tmp_path)
    try:
        pgid = group_of(tmp_path / PIDFILES[kind])
        assert pgid != driver.pid and orphans.group_members(pgid), "the child runs in its own group"
        kill_driver(driver)
        wait_for(lambda: not orphans.group_members(pgid), 10, f"group {pgid} to be gone after the parent's SIGKILL")
        wait_for(lambda: guard_of(pgid) is None, 5, "the guard to exit")  # a zombie has no command line
    finally:
        if driver.poll() is None:
            kill_driver(driver)
    note = tmp_path / ("server.log" if kind == "managed" else PIDFILES[kind].replace(".pid", ".guard.log"))
    assert f"the pipeline process {driver.pid} is gone; stopping its process group {pgid}" in note.read_text()


def test_guard_lets_go_when_the_group_stops_normally(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    guard = orphans.guard_group(child.pid, grace_s=1)
    wait_for(lambda: len(orphans.group_members(child.pid)) >= 2, 10, "grandchild")
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert guard.proc.wait(timeout=5) == 0, "the guard exits by itself once its group is gone"
    orphans.release(child.pid)


def test_next_start_reaps_a_group_whose_parent_and_guard_were_killed(tmp_path, caplog):
    from eagle3.serving.managed import ManagedServer, ServerError

    driver = start_driver("managed", tmp_path)
    pgid = group_of(tmp_path / "server.pid")
    guard = wait_for(lambda: guard_of(pgid), 10, "the guard")
    os.kill(guard, signal.SIGKILL)  # the guard goes first, then the parent: nothing stops the group now
    kill_driver(driver)
    time.sleep(1.5)
    orphans_left = orphans.group_members(pgid)
    assert len(orphans_left) >= 2, "without its guard the group outlives its parent"
    assert orphans.stale_members(tmp_path / "server.pid") == orphans_left
    # The next managed start in the same folder stops it before spawning its own server.
    with pytest.raises(ServerError, match="not ready within"):
        ManagedServer(
            [sys.executable, "-c", "import time; time.sleep(30)"],
            "m",
            log_path=tmp_path / "server.log",
            startup_timeout_s=1,
            stop_grace_s=1,
        ).start()
    assert not orphans.group_members(pgid)
    assert f"stopping process group {pgid} left running by a killed earlier run" in caplog.text


def test_pidfile_never_names_a_live_owners_group_or_a_reused_pid(tmp_path):
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        pidfile = tmp_path / "x.pid"
        orphans.write_pidfile(pidfile, child.pid)
        assert orphans.stale_members(pidfile) == [], "its owner (this process) is alive"
        info = json.loads(pidfile.read_text())
        dead_owner = {**info, "owner_pid": info["owner_pid"], "owner_start": -1}
        pidfile.write_text(json.dumps(dead_owner))
        assert orphans.stale_members(pidfile) == [child.pid], "owner gone, same group: an orphan"
        pidfile.write_text(json.dumps({**dead_owner, "leader_start": info["leader_start"] - 1}))
        assert orphans.stale_members(pidfile) == [], "a different start time: the pid was reused, not ours"
        pidfile.write_text(json.dumps({**dead_owner, "boot_id": "another-boot"}))
        assert orphans.stale_members(pidfile) == []
        pidfile.write_text("{not json")
        assert orphans.stale_members(pidfile) == [] and child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_guard_kills_descendants_in_other_sessions_that_ignore_sigterm(tmp_path):
    # Like torchrun: the leader starts its worker in a session of its own; here both ignore
    # SIGTERM, so only the guard's SIGKILL of the group *and* of the leader's descendants ends them.
    stubborn = (
        "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen(['python3', '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "time.sleep(300)'], start_new_session=True); time.sleep(300)"
    )
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        from eagle3 import orphans
        child = subprocess.Popen([sys.executable, "-c", {stubborn!r}], start_new_session=True)
        orphans.guard_group(child.pid, pidfile={str(tmp_path / "x.pid")!r}, grace_s=1)
        time.sleep(300)
    """)
    driver = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    worker = None
    try:
        pgid = wait_for(
            lambda: (
                (tmp_path / "x.pid").exists()
                and guard_of(json.loads((tmp_path / "x.pid").read_text())["pgid"])
                and json.loads((tmp_path / "x.pid").read_text())["pgid"]
            ),
            30,
            "pidfile and guard",
        )
        worker = wait_for(
            lambda: [
                p
                for p, st in ((int(e), orphans._stat(int(e))) for e in os.listdir("/proc") if e.isdigit())
                # exec'd (its own command line, not the leader's): Popen's child calls setsid before exec,
                # so a forked copy of the leader that has not yet left its session is not taken for the worker
                if st and int(st[1]) == pgid and b"Popen" not in _cmdline(p)
            ],
            30,
            "the leader's worker",
        )[0]
        assert int(orphans._stat(worker)[3]) == worker, "the worker leads a session of its own"
        kill_driver(driver)
        wait_for(
            lambda: not orphans.group_members(pgid) and gone(worker),
            10,
            "the group and the worker in another session to be gone",
        )
    finally:
        if driver.poll() is None:
            kill_driver(driver)
        if worker is not None and not gone(worker):
            os.kill(worker, signal.SIGKILL)  # it ignores SIGTERM: never leave it behind when the test fails
    # the guard notes the outcome after the group is gone: give it the moment that takes
    wait_for(lambda: "stopped" in (tmp_path / "x.guard.log").read_text(), 10, "the guard's note that the group stopped")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
