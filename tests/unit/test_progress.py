"""The run a person can watch: progress bars in a terminal, plain lines in a pipe, from the
board the stages report into and from the eagle3 command itself."""

import io
import os
import pty
import select
import subprocess
import sys
import time

from conftest import PYTHON, ROOT
from eagle3 import progress

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from test_kills import make_inputs  # noqa: E402


def test_a_stage_sums_its_parts_and_its_line_says_rate_eta_and_failures():
    board = progress.Board()
    board.report("generate", "shard-00000", 30, 100, failed=2, unit="samples")
    board.report("generate", "shard-00001", 10, 100, unit="samples")
    board.report("generate", "shard-00000", 40, 100, failed=3, unit="samples")  # a part's newer report replaces it
    (stage,) = board.snapshot()
    assert (stage.done, stage.total, stage.failed) == (50, 200, 3)
    stage.started -= 10.0  # as if it began 10 s ago: 5 samples/s, 150 to go
    line = stage.line()
    assert line.startswith("generate: 50/200 samples (25%), 5.0 samples/s, ETA ") and line.endswith("failed 3")
    assert "ETA 30 s" in line
    board.finish("generate")
    assert board.snapshot()[0].line().endswith("done, failed 3")


def test_lines_in_a_pipe_every_interval_and_a_last_line_per_stage():
    out = io.StringIO()  # not a terminal: plain lines
    with progress.watch(out, every_s=0.2, refresh_s=0.05):
        progress.report("extract", "shard-00000", 100, 400, unit="tokens")
        time.sleep(0.5)
        progress.report("extract", "shard-00000", 400, 400, unit="tokens")
        progress.finish("extract")
        time.sleep(0.2)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("extract: 100/400 tokens (25%)") for line in lines), lines
    assert lines[-1].startswith("extract: 400/400 tokens (100%)") and "done" in lines[-1], lines
    assert sum("done" in line for line in lines) == 1, "a finished stage says so once"
    assert "\x1b[" not in out.getvalue(), "no terminal escapes in a pipe"


def eagle3_tokenize(run, *extra, terminal: bool, api: str):
    """`eagle3 tokenize` on a run with finished generations, its stderr a pty or a pipe, its flow on the
    Prefect server at ``api``."""
    argv = [PYTHON, "-m", "cli", "tokenize", "--set", f'run_dir="{run}"', "--set", "data.num_shards=2", *extra]
    env = {**os.environ, "COLUMNS": "120", "PREFECT_API_URL": api}
    if not terminal:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=follower, stdin=follower)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_the_command_draws_bars_on_a_terminal_and_lines_in_a_pipe(tmp_path, prefect_api):
    make_inputs(tmp_path / "bars", n=60)
    make_inputs(tmp_path / "lines", n=60)
    make_inputs(tmp_path / "off", n=60)
    drawn = eagle3_tokenize(
        tmp_path / "bars", "--config", str(ROOT / "recipes" / "tiny-demo.toml"), terminal=True, api=prefect_api
    )
    assert "━" in drawn and "2/2 shards" in drawn, drawn[-2000:]  # rich's bar, and the count
    plain = eagle3_tokenize(
        tmp_path / "lines", "--config", str(ROOT / "recipes" / "tiny-demo.toml"), terminal=False, api=prefect_api
    )
    assert "tokenize: 2/2 shards (100%)" in plain and "━" not in plain, plain[-2000:]
    quiet = eagle3_tokenize(
        tmp_path / "off",
        "--config",
        str(ROOT / "recipes" / "tiny-demo.toml"),
        "--progress",
        "off",
        terminal=False,
        api=prefect_api,
    )
    assert "tokenize: 2/2 shards" not in quiet
