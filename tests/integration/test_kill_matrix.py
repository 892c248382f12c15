"""`eagle3 run` SIGKILLed inside each stage in turn, rerun, and compared with uninterrupted runs.

The CLI runs in its own session, as a terminal or scheduler starts it; each kill is a SIGKILL of
its whole process group, so no cleanup code of the CLI runs. What must hold:
- no process of the killed run survives it: the managed vLLM server (API server, EngineCore,
  Worker, resource tracker) and torchrun run in their own sessions and are stopped by their
  guards (eagle3/orphans.py) within seconds;
- the rerun after the last kill finishes with exit 0;
- prepare's output is byte-identical to an uninterrupted prepare;
- generation (sampled, so not comparable byte for byte) holds exactly one record
  (ok, failed or filtered) per prepared prompt id, and in == ok + failed + filtered;
- tokenize, vocab, extract and train, compared with an uninterrupted run of those stages on a
  copy of the killed run's prompts and generations: tokenized Parquet, vocabulary and hidden
  states byte-identical; training resumed inside the run, with the same steps, learning rates
  and batches, and the same loss curve and final weights up to float rounding (CURVE_RTOL).
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import DEMO_RECIPE, PYTHON, ROOT
from eagle3 import stages

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")

# Every stage of the registry is killed in turn, but these two, which keep nothing partial to resume:
# a kill inside them is followed by a rerun that redoes them whole (their servers are stopped by the
# same guards as generate's, which this test does check).
NOT_KILLED = {
    "export": "each layout is written to a temporary folder and renamed into place; orphans are removed on rerun",
    "evaluate": "its only output, live.json, is written atomically at its end",
}
STAGES = tuple(name for name in stages.names() if name not in NOT_KILLED)
# Small and quick; concurrency 2 stretches generation over seconds so the kill lands mid-shard;
# small training batches and a checkpoint every 2 steps give a resume point inside training.
SMALL = [
    "data.limit=40",
    "data.num_shards=2",
    "generation.max_tokens=64",
    "generation.concurrency=2",
    "train.epochs=2",
    "train.batch_tokens=512",
    "train.save_every_steps=2",
    f'server.python="{VLLM_PYTHON}"',
]
# Two training processes on the same inputs usually agree bit for bit, but not always: once in CI
# the uninterrupted reference differed from the killed run in the last bits of one step's loss
# (5.6e-7 relative at most, growing no further over 16 steps). A resume bug is four orders of
# magnitude louder, measured on this test's config by resuming from step 2 of 18 with the bug
# planted: Adam state not restored, 1.5e-2 at the first resumed step; resumed one step early, 0.24.
CURVE_RTOL = 1e-5
BEGIN = re.compile(r"Flow run '([^']+)' - Beginning subflow run '[^']+' for flow 'eagle3-(\w+)'")
# Files whose content names the run dir or a time: compared with these keys dropped and the run dir replaced.
VOLATILE_KEYS = {"seconds", "recorded_at", "written_at"}


def _stat(pid: int):
    """(state, ppid, session, start ticks) from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def process_table() -> dict[int, tuple]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))):
            table[int(entry)] = st
    return table


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def live_in_sessions(sessions: dict[int, int]) -> list[str]:
    """Live (not zombie) processes in any of ``sessions`` ({session id: its leader's start
    ticks}), as 'pid cmdline' lines. A session id is a pid, and pids wrap (pid_max is 32768
    here): a leader with that pid but another start time means the number was reused after
    our session emptied, and its processes are someone else's."""
    table = process_table()
    return [
        f"{pid} {cmdline(pid)[:160]}"
        for pid, (state, _, sid, _) in table.items()
        if sid in sessions and state != "Z" and (sid not in table or table[sid][3] == sessions[sid])
    ]


class Cli:
    """One `eagle3` command in its own session; output collected; every descendant's session
    recorded while it runs (vLLM and torchrun start their own), to look for survivors later."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.begun: dict[str, tuple[str, float]] = {}  # stage -> (flow run name, time its subflow began)
        self.sessions: dict[int, int] = {}  # session id -> its leader's start ticks
        self.seen: dict[int, str] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.append(line.rstrip("\n"))
            if found := BEGIN.search(line):
                self.begun.setdefault(found.group(2), (found.group(1), time.monotonic()))

    def snapshot(self) -> None:
        table = process_table()
        if self.proc.pid in table:
            self.sessions.setdefault(self.proc.pid, table[self.proc.pid][3])
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                sid = table[child][2]
                if sid in table:
                    self.sessions.setdefault(sid, table[sid][3])
                self.seen[child] = cmdline(child) or self.seen.get(child, "")  # after exec, not the forked parent's
                todo.append(child)

    def run_until(self, ready, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.snapshot()
            if ready(self):
                return True
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        self.snapshot()
        with contextlib.suppress(ProcessLookupError):  # it may have exited (then the test says why)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join(5)

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() >= deadline:
                self.kill()  # its guards stop whatever it started
                raise AssertionError(f"`eagle3` still running after {timeout_s} s:\n" + self.tail())
            self.snapshot()
            time.sleep(0.2)
        self.reader.join(5)
        return self.proc.returncode

    def inside(self, stage: str) -> bool:
        """The stage's subflow began and had not finished (no 'Finished in state' line for it)."""
        if stage not in self.begun or list(self.begun)[-1] != stage:
            return False
        name = self.begun[stage][0]
        return not any(f"Flow run '{name}' - Finished in state" in line for line in self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def shard_lines(folder: Path, pattern: str) -> int:
    return sum(len(f.read_bytes().splitlines()) for f in folder.glob(pattern))


def latest_step(run: Path) -> int:
    try:
        return json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError):
        return 10**9  # being replaced right now: not yet


def since_begin(cli: Cli, stage: str) -> float:
    return time.monotonic() - cli.begun[stage][1] if stage in cli.begun else -1.0


def triggers(run: Path) -> dict:
    """When to kill, per stage: as soon as it has begun and (where the stage is long enough to
    tell) part of its output is on disk; a fallback delay keeps a fast stage from slipping by."""
    return {
        "prepare": lambda cli: "prepare" in cli.begun,
        "generate": lambda cli: "generate" in cli.begun and shard_lines(run / "generations", "shard-?????.jsonl") >= 4,
        "tokenize": lambda cli: (
            "tokenize" in cli.begun
            and (any((run / "tokenized").glob("shard-*.done.json")) or since_begin(cli, "tokenize") > 4.0)
        ),
        "vocab": lambda cli: "vocab" in cli.begun,
        "extract": lambda cli: (
            "extract" in cli.begun
            and (any((run / "hidden_states").glob("shard-*.done.json")) or since_begin(cli, "extract") > 6.0)
        ),
        # A checkpoint, and a step logged after it: the resumed run must drop that line and redo the step.
        "train": lambda cli: (
            (run / "checkpoints" / "latest.json").exists()
            and shard_lines(run / "train", "log.jsonl") > latest_step(run)
        ),
    }


def partial_state(run: Path, stage: str) -> str:
    """What the killed stage had on disk, for the test's report."""
    if stage == "prepare":
        return f"prompts/done.json {'present' if (run / 'prompts' / 'done.json').exists() else 'absent'}"
    if stage == "generate":
        return (
            f"{shard_lines(run / 'generations', 'shard-?????.jsonl')} records, "
            f"{len(list((run / 'generations').glob('*.done.json')))}/2 shards done"
        )
    if stage == "tokenize":
        return f"{len(list((run / 'tokenized').glob('*.done.json')))}/2 shards done"
    if stage == "vocab":
        return (
            f"draft_vocab.safetensors {'present' if (run / 'vocab' / 'draft_vocab.safetensors').exists() else 'absent'}"
        )
    if stage == "extract":
        return f"{len(list((run / 'hidden_states').glob('*.done.json')))}/2 shards done"
    return f"checkpoint step {latest_step(run)}, {shard_lines(run / 'train', 'log.jsonl')} steps logged"


def wait_no_survivors(sessions: dict[int, int], timeout_s: float = 45.0) -> float:
    began = time.monotonic()
    while (left := live_in_sessions(sessions)) and time.monotonic() - began < timeout_s:
        time.sleep(0.2)
    assert not left, "processes of the killed run are still alive:\n" + "\n".join(left)
    return time.monotonic() - began


def normalized_json(path: Path, run: Path):
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in VOLATILE_KEYS}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value.replace(str(run), "RUN") if isinstance(value, str) else value

    return clean(json.loads(path.read_text()))


def assert_same_files(a_run: Path, b_run: Path, folder: str, patterns: tuple[str, ...]) -> list[str]:
    """Every file matching ``patterns`` under ``folder`` exists in both runs with the same bytes
    (JSON files: the same content once times are dropped and the run dir is replaced)."""
    names = sorted({f.name for p in patterns for f in (a_run / folder).glob(p)})
    other = sorted({f.name for p in patterns for f in (b_run / folder).glob(p)})
    assert names and names == other, (folder, names, other)
    for name in names:
        a, b = a_run / folder / name, b_run / folder / name
        if name.endswith(".json"):
            assert normalized_json(a, a_run) == normalized_json(b, b_run), f"{folder}/{name} differs"
        else:
            assert a.read_bytes() == b.read_bytes(), f"{folder}/{name} differs from the uninterrupted run's"
    return names


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def max_relative_difference(a: list[dict], b: list[dict], keys: tuple[str, ...]) -> float:
    """The largest |x - y| / |y| over the float values (or lists of them) under ``keys``, line by line."""
    assert len(a) == len(b), (len(a), len(b))
    worst = 0.0
    for x, y in zip(a, b):
        for key in keys:
            xs, ys = (x[key], y[key]) if isinstance(x[key], list) else ([x[key]], [y[key]])
            assert len(xs) == len(ys), key
            worst = max([worst, *(abs(p - q) / max(abs(q), 1e-12) for p, q in zip(xs, ys))])
    return worst


def assert_same_eval_counts(a: list[dict], b: list[dict]) -> None:
    """Held-out evaluations at the same steps over the same positions; each accuracy may move by at
    most one position (an argmax that float rounding tips between two near-equal logits)."""
    assert [(x["step"], x["positions"], x["heldout_samples"]) for x in a] == [
        (y["step"], y["positions"], y["heldout_samples"]) for y in b
    ]
    for x, y in zip(a, b):
        for key in ("accuracy", "conditional_accuracy"):
            moved = max(abs(p - q) for p, q in zip(x[key], y[key])) * x["positions"]
            assert moved <= 1 + 1e-9, f"eval at step {x['step']}: {key} {x[key]} vs {y[key]}"


def assert_close_weights(a: Path, b: Path) -> None:
    from safetensors.numpy import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    assert sorted(wa) == sorted(wb)
    for name in wa:
        gap = float(abs(wa[name].astype("float64") - wb[name].astype("float64")).max())
        scale = float(abs(wb[name].astype("float64")).max())
        assert gap <= 1e-6 + CURVE_RTOL * 10 * scale, f"final weights {name}: differ by {gap:.2e} (max |w| {scale:.2e})"


@needs_vllm
@pytest.mark.timeout(900)
def test_sigkill_inside_each_stage_then_rerun_matches_uninterrupted(tmp_path, prefect_api):
    # Every run here reports to the suite's Prefect server: a temporary one per `eagle3` command would add
    # ~12 s to each of the 12 (a run with its own temporary server is test_flows.py's end-to-end test). The
    # kills are of the command's whole process group, so a temporary server would die with it anyway.
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONUNBUFFERED": "1"}
    env["PREFECT_API_URL"] = prefect_api
    shared = env
    run, ref_prep, ref = tmp_path / "killed", tmp_path / "ref-prepare", tmp_path / "ref-stages"
    sets = ["--config", str(DEMO_RECIPE), *(a for s in SMALL for a in ("--set", s))]
    in_run = lambda r: [*sets, "--set", f'run_dir="{r}"']  # noqa: E731
    sessions: dict[int, int] = {}
    report = []
    began = time.monotonic()

    # 1. Kill inside each stage in turn, each kill followed by a rerun.
    for n, stage in enumerate(STAGES):
        cli = Cli(["run", *in_run(run)], env, tmp_path / f"run-{n}-{stage}.log")
        try:
            reached = cli.run_until(triggers(run)[stage], timeout_s=240)
        finally:
            cli.kill()
        assert reached, f"the run never reached the kill point in {stage} (exit {cli.proc.returncode}):\n{cli.tail()}"
        assert cli.inside(stage), (
            f"the kill meant for {stage} landed elsewhere (begun: {list(cli.begun)}):\n{cli.tail()}"
        )
        state = partial_state(run, stage)
        seen = "\n".join(cli.seen.values())
        if stage == "generate":
            assert "vllm.entrypoints.openai.api_server" in seen and "VLLM::EngineCore" in seen, (
                "the kill met a running vLLM server"
            )
        if stage == "train":
            assert "torch.distributed.run" in seen and "eagle3.train.worker" in seen, "the kill met a running torchrun"
        gone_s = wait_no_survivors(cli.sessions)
        sessions |= cli.sessions
        report.append(f"killed in {stage:8s} ({state}); its processes gone {gone_s:.1f} s after the kill")
    # The last rerun through export: evaluate, which keeps nothing partial to resume (NOT_KILLED), would
    # only start one more vLLM here; the whole demo's evaluate, stopped and resumed, is test_clean_stop.py's.
    final = Cli(["run", *in_run(run), "--until", "export"], shared, tmp_path / "run-final.log")
    assert final.wait(600) == 0, final.tail()
    assert list(final.begun)[-1] == "export" and not (run / "evaluate").exists(), "--until export ran past export"
    assert "vllm.entrypoints" not in "\n".join(final.seen.values()), "the resumed run needed no server"
    sessions |= final.sessions
    wait_no_survivors(sessions, timeout_s=30)
    kill_matrix_s = time.monotonic() - began

    # 2. Uninterrupted references: prepare alone, and tokenize..train on a copy of the killed run's inputs.
    prep = Cli(["prepare", *in_run(ref_prep)], shared, tmp_path / "ref-prepare.log")
    assert prep.wait(180) == 0, prep.tail()
    sessions |= prep.sessions
    shutil.copytree(run / "prompts", ref / "prompts")
    shutil.copytree(run / "generations", ref / "generations", ignore=shutil.ignore_patterns("*.lock", "*.pid", "*.log"))
    # One command runs them in order: prepare and generate find their work copied in (no server), the rest run.
    cli = Cli(["run", *in_run(ref), "--until", "train"], shared, tmp_path / "ref-stages.log")
    assert cli.wait(300) == 0, cli.tail()
    assert "vllm.entrypoints" not in "\n".join(cli.seen.values()), "a complete generation dir needs no server"
    assert [s for s in cli.begun if s in ("export", "evaluate")] == [], "--until train ran past train"
    sessions |= cli.sessions
    wait_no_survivors(sessions, timeout_s=30)  # nothing any of these runs started is left

    # 3. No temporary of a write the kills cut short is left anywhere in the run dir.
    leftovers = sorted(str(f.relative_to(run)) for f in run.rglob(".*") if re.search(r"\.(tmp|partial|old)$", f.name))
    assert not leftovers, f"temporaries of killed writes left behind: {leftovers}"

    # prepare: byte-identical.
    assert_same_files(run, ref_prep, "prompts", ("shard-*.parquet", "rejected.jsonl", "done.json"))

    # 4. generate: exactly one record per prepared prompt, and the accounting adds up.
    import pyarrow.parquet as pq

    prompt_ids = [
        i
        for f in sorted((run / "prompts").glob("shard-*.parquet"))
        for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()
    ]
    records = [
        r["id"]
        for kind in ("jsonl", "failed.jsonl", "filtered.jsonl")
        for f in sorted((run / "generations").glob(f"shard-?????.{kind}"))
        for r in read_jsonl(f)
    ]
    assert len(records) == len(set(records)), "a prompt has more than one generation record"
    assert sorted(records) == sorted(prompt_ids), "generation records and prepared prompts differ"
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    gen = manifest["generate"]
    assert gen["in"] == len(prompt_ids) == gen["ok"] + gen["failed"] + gen["filtered"], gen

    # 5. tokenize, vocab, extract: byte-identical to the uninterrupted run.
    assert_same_files(
        run,
        ref,
        "tokenized",
        ("shard-*.parquet", "shard-*.counts.safetensors", "shard-*.rejected.jsonl", "shard-*.done.json"),
    )
    assert_same_files(run, ref, "vocab", ("*",))
    assert_same_files(run, ref, "hidden_states", ("shard-*.safetensors", "shard-*.index.json", "shard-*.done.json"))

    # 6. train: resumed inside training, and the uninterrupted run's curve from the resumed step on.
    resumed = [m for line in final.lines if (m := re.search(r"resumed from .* \(step (\d+) of (\d+)\)", line))]
    assert resumed, "the final run did not resume training from a checkpoint"
    step, total = int(resumed[0].group(1)), int(resumed[0].group(2))
    assert 0 < step < total
    killed_log, ref_log = read_jsonl(run / "train" / "log.jsonl"), read_jsonl(ref / "train" / "log.jsonl")
    assert [x["step"] for x in killed_log] == list(range(1, total + 1)), "one log line per step, none twice"
    exact = ("step", "epoch", "lr", "tokens")  # the schedule and the data order: pure functions of the step
    assert [[x[k] for k in exact] for x in killed_log] == [[x[k] for k in exact] for x in ref_log], (
        "steps, learning rates or batches differ"
    )
    drift = max(
        max_relative_difference(killed_log, ref_log, ("loss", "loss_per_step")),
        max_relative_difference(
            read_jsonl(run / "train" / "eval.jsonl"), read_jsonl(ref / "train" / "eval.jsonl"), ("loss_per_step",)
        ),
    )
    assert drift <= CURVE_RTOL, (
        f"the loss curve differs from the uninterrupted run's by {drift:.2e} (relative) > {CURVE_RTOL:.0e}"
    )
    assert_same_eval_counts(read_jsonl(run / "train" / "eval.jsonl"), read_jsonl(ref / "train" / "eval.jsonl"))
    final_ckpt = f"checkpoints/step-{total:06d}/model.safetensors"
    bitwise = drift == 0 and (run / final_ckpt).read_bytes() == (ref / final_ckpt).read_bytes()
    if not bitwise:
        assert_close_weights(run / final_ckpt, ref / final_ckpt)
    report.append(
        f"training resumed at step {step} of {total}; loss curve and final weights "
        + (
            "bitwise equal to the uninterrupted run"
            if bitwise
            else f"within {drift:.1e} (relative) of the uninterrupted run"
        )
    )

    print(
        "\n".join(
            [
                "",
                *report,
                f"kill matrix + final run: {kill_matrix_s:.0f} s; whole test {time.monotonic() - began:.0f} s",
            ]
        )
    )
