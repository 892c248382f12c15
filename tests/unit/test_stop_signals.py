"""An `eagle3` command stopped while it starts its temporary Prefect server (no vLLM yet): the server
goes with it, after a SIGKILL of the command (its guard stops it) as after a SIGINT (the command's own
stop, which exits 130 with one line). The whole stop with vLLM, torchrun and a rerun:
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
