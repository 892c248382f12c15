"""eagle3/proc.py: a child process group started under a guard, its output pumped, held to a
deadline and stopped (SIGTERM, grace, SIGKILL), with small python children as stand-ins."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3 import orphans, proc

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")

# Ignores SIGTERM, starts a grandchild in its group and one in a session of its own (both ignore
# SIGTERM too), says their pids, then sleeps.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
same = subprocess.Popen([sys.executable, "-c", code])
other = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
print("KIDS", same.pid, other.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Running; a zombie counts as gone (it holds no memory, port or GPU)."""
    stat = orphans._stat(pid)
    return stat is not None and stat[0] != "Z"


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def kids(child: proc.Child) -> list[int]:
    line = wait_for(lambda: [ln for ln in child.tail() if ln.startswith("KIDS ")], 20, "the grandchildren")[0]
    return [int(pid) for pid in line.split()[1:]]


def guard_running(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            argv = orphans.cmdline(int(entry))
            if len(argv) > 4 and argv[3].endswith("guard.py") and argv[4] == str(pgid) and alive(int(entry)):
                return True
    return False


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_with_its_whole_tree(tmp_path, caplog):
    child = proc.Child(
        [sys.executable, "-c", STUBBORN], name="stubborn", logger=logging.getLogger("t"), grace_s=1
    ).start()
    same_group, other_session = kids(child)
    assert alive(child.pid) and alive(same_group) and alive(other_session)
    began = time.monotonic()
    assert child.stop() == [], "nothing survives SIGKILL"
    assert 1 <= time.monotonic() - began < 10, "SIGKILL came after the grace, not before, not much later"
    assert child.returncode == -signal.SIGKILL
    assert not alive(child.pid) and not alive(same_group), "the whole process group is gone"
    assert not alive(other_session), "and the descendant that left the group"
    assert f"stubborn group {child.pid} still alive 1 s after SIGTERM: sending SIGKILL" in caplog.text
    wait_for(lambda: not guard_running(child.pid), 5, "the guard to be released")


def test_a_child_past_its_deadline_is_stopped_and_the_error_names_the_deadline_and_the_log(tmp_path):
    log = tmp_path / "child.log"
    code = "import time; print('warming up', flush=True); time.sleep(300)"
    child = proc.Child([sys.executable, "-c", code], name="sleeper", logger=logging.getLogger("t"), log_path=log)
    child.start()
    wait_for(lambda: child.tail(), 20, "the first line")
    began = time.monotonic()
    with pytest.raises(proc.DeadlineExceeded) as caught:
        child.wait(timeout_s=1.5)
    assert 1.5 <= time.monotonic() - began < 15
    message = str(caught.value)
    assert "sleeper ran past its deadline of 1.5 s and was stopped" in message
    assert str(log) in message and "warming up" in message
    assert caught.value.timeout_s == 1.5 and caught.value.tail == ["warming up"]
    assert not alive(child.pid) and child.returncode == -signal.SIGTERM


def test_run_gives_the_exit_code_and_stops_what_the_child_left_in_its_group(tmp_path):
    code = (
        "import subprocess, sys; k = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
        "print('KIDS', k.pid, flush=True); sys.exit(3)"
    )
    child = proc.run([sys.executable, "-c", code], timeout_s=60, name="quitter", logger=logging.getLogger("t"))
    assert child.returncode == 3, "the caller judges the code; run() does not raise for it"
    (leftover,) = kids(child)
    assert not alive(leftover), "a grandchild the child left behind is stopped"


def test_the_pump_writes_the_log_file_logs_scrubbed_lines_and_feeds_on_line(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    log = tmp_path / "sub" / "child.log"
    seen: list[str] = []

    def on_line(line: str) -> None:
        seen.append(line)
        if line == "two":
            raise ValueError("display broke")  # must not stop the pump

    code = (
        "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); "
        "print('WARNING the secret is s3cr3t', flush=True); print('caf\\u00e9 done', flush=True)"
    )
    child = proc.run(
        [sys.executable, "-c", code],
        timeout_s=60,
        name="talker",
        logger=logging.getLogger("talk"),
        log_path=log,
        prefix="[talk]",
        scrub="s3cr3t",
        level_of=lambda line: logging.WARNING if line.startswith("WARNING") else logging.INFO,
        on_line=on_line,
        tail_lines=3,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    lines = ["one", "two", "WARNING the secret is ***", "caf\u00e9 done"]
    assert child.returncode == 0 and seen == lines, "stdout and stderr, in order, each line once"
    assert child.tail() == lines[-3:]
    text = log.read_text(encoding="utf-8")
    header, *rest = text.splitlines()
    assert header.startswith("=== ") and header.endswith(f"starting: {sys.executable} -c {code}")
    assert rest == lines, "every output line, the secret scrubbed (argv, in the header, is the caller's to keep clean)"
    assert "s3cr3t" not in caplog.text and "[talk] WARNING the secret is ***" in caplog.text
    levels = {r.getMessage(): r.levelno for r in caplog.records if r.name == "talk"}
    assert levels["[talk] WARNING the secret is ***"] == logging.WARNING and levels["[talk] one"] == logging.INFO
    assert "talker: output handler failed: display broke" in caplog.text


def test_the_pump_keeps_draining_when_the_log_file_fails(tmp_path, caplog):
    child = proc.Child(
        [sys.executable, "-c", "print('a', flush=True); print('b', flush=True)"],
        name="c",
        logger=logging.getLogger("t"),
        log_path=tmp_path / "c.log",
    )
    real_open = open

    class Broken:
        closed = False

        def write(self, _text):
            raise OSError(28, "No space left on device")

        def close(self):
            self.closed = True

    child._open_log = lambda: (real_open(tmp_path / "c.log", "a").close(), Broken())[1]
    child.start()
    assert child.wait(60) == 0
    child.stop()
    assert child.tail() == ["a", "b"], "every line still reaches the tail and the logger"
    assert "c log file" in caplog.text and "unwritable, logging only" in caplog.text


def test_start_reaps_a_group_a_killed_run_left_and_guards_the_new_one(tmp_path, caplog):
    pidfile = tmp_path / "child.pid"
    # A group as a SIGKILLed run leaves it when its guard died too: no guard, its owner gone.
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    orphans.write_pidfile(pidfile, old.pid)
    info = json.loads(pidfile.read_text())
    pidfile.write_text(json.dumps({**info, "owner_start": -1}))
    new = proc.Child(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        name="new",
        logger=logging.getLogger("t"),
        pidfile=pidfile,
        grace_s=1,
    ).start()
    try:
        wait_for(lambda: not alive(old.pid), 10, "the orphaned group to be stopped")
        assert f"stopping process group {old.pid} left running by a killed earlier run" in caplog.text
        assert json.loads(pidfile.read_text())["pgid"] == new.pid, "the new group is recorded"
        wait_for(lambda: guard_running(new.pid), 10, "the new group's guard")
    finally:
        new.stop()
        old.kill()
        old.wait()


def test_a_program_that_cannot_start_raises_oserror(tmp_path):
    child = proc.Child([str(tmp_path / "missing")], name="x", logger=logging.getLogger("t"), log_path=tmp_path / "l")
    with pytest.raises(OSError):
        child.start()
    assert child.pid is None and child.stop() == []


def test_stop_before_start_and_twice_is_harmless():
    child = proc.Child([sys.executable, "-c", "pass"], name="x", logger=logging.getLogger("t"))
    assert child.stop() == []
    child.start()
    assert child.wait(60) == 0
    assert child.stop() == [] and child.stop() == []


def test_a_path_child_cwd_and_env_are_passed(tmp_path: Path):
    code = "import os; print(os.getcwd(), os.environ.get('PROC_TEST'), flush=True)"
    child = proc.run(
        [sys.executable, "-c", code],
        timeout_s=60,
        name="x",
        logger=logging.getLogger("t"),
        cwd=tmp_path,
        env={**os.environ, "PROC_TEST": "yes"},
    )
    assert child.tail() == [f"{tmp_path} yes"]
