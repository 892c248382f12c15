"""An `eagle3` command stopped while it starts its temporary Prefect server (no vLLM yet): the server
goes with it, after a SIGKILL of the command (its guard stops it) as after a SIGINT (the command's own
stop, which exits 130 with one line). And a second signal, while the first stop waits on a child that
ignores SIGTERM, SIGKILLs it at once. The whole stop with vLLM, torchrun and a rerun:
tests/integration/test_clean_stop.py. Each test costs the command's start (~5 s), not a server's."""

import os
import shlex
import signal
import subprocess
import time
import uuid

import pytest

from conftest import DEMO_RECIPE, PYTHON, ROOT
from procs import marked

PREFECT_SERVER = "prefect.server.api.server:create_app"


def wait_for(what, timeout_s: float, step_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(step_s)
    return what()


@pytest.fixture
def command(tmp_path):
    """`eagle3 prepare` with no PREFECT_API_URL (so it starts a temporary Prefect server), in its own
    session as a shell runs it, every process it starts marked; returns (Popen, mark, argv) once the
    server's process is up."""
    mark = f"EAGLE3_STOP_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), mark.split("=")[0]: mark.split("=")[1]}
    env.pop("PREFECT_API_URL", None)
    argv = ["prepare", "--config", str(DEMO_RECIPE), "--set", f'run_dir="{tmp_path / "run"}"', "--progress", "off"]
    proc = subprocess.Popen(
        [PYTHON, "-m", "cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        server = wait_for(lambda: [p for p, cmd in marked(mark).items() if PREFECT_SERVER in cmd], 120)
        assert server, f"no temporary Prefect server started (exit {proc.poll()}):\n{proc.communicate()[1][-2000:]}"
        yield proc, mark, argv
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        for pid in marked(mark):  # a failed test must not leave the server behind either
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_command_takes_its_temporary_prefect_server_down(command):
    proc, mark, _ = command
    proc.kill()  # the command alone, as the OOM killer or `kill -9 PID` does: no cleanup of its own runs
    proc.wait()
    left = wait_for(lambda: not marked(mark), 10)
    assert left, f"still running 10 s after the command's SIGKILL: {marked(mark)}"


def test_sigint_stops_the_command_and_its_server_with_one_line_and_exit_130(command):
    proc, mark, argv = command
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)  # as `kill -INT PID`; a terminal's Ctrl-C reaches only the command too
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - began
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        "eagle3 prepare: stopped by SIGINT, nothing it started is left running; to resume, run the same command: "
        + shlex.join(["eagle3", *argv])
    ), last
    assert not marked(mark), f"left running after the command exited: {marked(mark)}"
    assert took < 15, f"the stop took {took:.1f} s"


# A command stopping while a child ignores SIGTERM (vLLM's API server while its engine starts): the first
# SIGTERM's stop waits out the grace for it; a second SIGTERM cuts the wait short. The command here is
# cli/stopping.py and eagle3/orphans.py as cli/main.py drives them, around a guarded child, so the wait is
# the real one and nothing depends on when a server happens to be slow.
SECOND_SIGNAL = """
import subprocess, sys, time
from cli import stopping
from eagle3 import orphans

IGNORES_SIGTERM = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); print(flush=True); time.sleep(600)"
with stopping.installed("stubborn", ["stubborn"], resumable=False):
    try:
        with orphans.starting():
            child = subprocess.Popen(
                [sys.executable, "-c", IGNORES_SIGTERM], start_new_session=True, stdout=subprocess.PIPE
            )
            orphans.guard_group(child.pid)
        child.stdout.readline()  # it ignores SIGTERM from here on
        print(child.pid, flush=True)
        time.sleep(600)
    except BaseException as exc:
        signum = stopping.signal_of(exc)
        print("stopping", flush=True)
        stopping.finish(signum)
"""


def test_a_second_signal_sigkills_what_ignores_the_first_at_once(tmp_path):
    from cli.stopping import GRACE_S

    mark = f"EAGLE3_STOP_TEST={uuid.uuid4().hex}"
    env = {**os.environ, mark.split("=")[0]: mark.split("=")[1], "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [PYTHON, "-c", SECOND_SIGNAL], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "stopping"  # the first stop is under way, waiting on the child
        time.sleep(1.0)
        assert proc.poll() is None and child in marked(mark), "the first SIGTERM alone waits out the grace"
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=GRACE_S)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "eagle3 stubborn: stopped by SIGTERM (a second signal: SIGKILL at once), nothing it started is left running"
    ), err[-3000:]
    assert not marked(mark), f"left running after the command exited: {marked(mark)}"
    assert took < GRACE_S / 3, f"the second signal took {took:.1f} s to end the command"
