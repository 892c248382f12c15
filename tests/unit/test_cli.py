"""The eagle3 command, run as a user runs it (a subprocess)."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import DEMO_RECIPE, PYTHON, ROOT

EAGLE3 = [PYTHON, "-m", "cli"]


def run(*args, cwd=None, env=None):
    return subprocess.run(
        [*EAGLE3, *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}, timeout=300
    )


def test_help_is_instant_and_imports_nothing_heavy():
    code = (
        "import sys, contextlib, io\n"
        "from cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main.main(['--help'])\n"
        "heavy = [m for m in ('torch', 'prefect', 'transformers', 'datasets', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([PYTHON, "-c", code], check=True, timeout=60)
    result = run("--help")
    assert result.returncode == 0
    for command in (
        "run",
        "prepare",
        "generate",
        "tokenize",
        "vocab",
        "extract",
        "train",
        "evaluate",
        "export",
        "status",
        "make-tiny",
        "config",
    ):
        assert command in result.stdout


def test_flows_and_tasks_import_without_torch():
    """Every module of flows/ and tasks/, imported for real (test_import_graph.py reads the same with ast)."""
    modules = [f"{p.parent.name}.{p.stem}" for d in ("flows", "tasks") for p in sorted((ROOT / d).glob("[!_]*.py"))]
    code = (
        f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([PYTHON, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_config_show_prints_resolved_toml(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('run_dir = "runs/x"\n[generation]\nconcurrency = 8\n')
    result = run(
        "config", "show", "--config", str(cfg), "--set", "generation.max_tokens=99", "--set", "data.source=p.jsonl"
    )
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["run_dir"] == "runs/x"
    assert shown["generation"]["concurrency"] == 8 and shown["generation"]["max_tokens"] == 99
    assert shown["data"]["source"] == "p.jsonl"
    docs = run("config", "show", "--docs")
    assert "# Number of prompt shards" in docs.stdout


def test_config_error_is_one_clear_message(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlearning_rte = 1\n")
    result = run("prepare", "--config", str(cfg))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"{cfg}: train.learning_rte: unknown key (did you mean train.learning_rate?)" in result.stderr


def test_bad_source_is_one_clear_message(tmp_path):
    result = run(
        "prepare",
        "--config",
        str(DEMO_RECIPE),
        "--set",
        f'run_dir="{tmp_path}/r"',
        "--set",
        "data.source=./missing.jsonl",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "data.source './missing.jsonl': no such file or folder" in result.stderr


def test_status_reads_the_manifest(tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare

    run_prepare(load_config(DEMO_RECIPE, [f'run_dir="{tmp_path}"']))
    result = run("status", str(tmp_path))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("prepare"))
    assert line.split()[:6] == ["prepare", "ok", "313", "302", "0", "11"]
    missing = run("status", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "not a run directory" in missing.stderr


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "eagle3"
    assert exe.exists()
    assert subprocess.run([str(exe), "--help"], capture_output=True, timeout=60).returncode == 0


def test_make_tiny_builds_a_loadable_model(tmp_path):
    result = run("make-tiny", str(tmp_path / "tiny"), "--arch", "llama")
    assert result.returncode == 0, result.stderr
    assert f"built tiny llama model and tokenizer in {tmp_path / 'tiny'}" in result.stdout
    config = __import__("json").loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 128


def test_extract_without_tokenized_shards_is_one_clear_message(tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare

    run_prepare(load_config(DEMO_RECIPE, [f'run_dir="{tmp_path}"']))
    result = run("extract", "--config", str(DEMO_RECIPE), "--set", f'run_dir="{tmp_path}"')
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "shard-00000.done.json not found: shard shard-00000.parquet has not been tokenized" in result.stderr


def test_the_run_report_reads_everything_from_the_run_dir(tmp_path):
    from eagle3.manifest import record_stage
    from eagle3.report import write_report
    from eagle3.results import StageCounts

    record_stage(tmp_path, "prepare", StageCounts(5, 3, 0, 2, {"empty": 2}), status="ok")
    record_stage(tmp_path, "generate", StageCounts(3, 2, 1, 0, {"timeout": 1}), status="ok")
    record_stage(
        tmp_path,
        "tokenize",
        StageCounts(2, 2),
        status="ok",
        tokens=300,
        supervised_tokens=200,
        truncated_rows=1,
        template_check={"mismatch_rate": {"prompt_mismatch": 0.0, "full_mismatch": 0.5}},
    )
    record_stage(
        tmp_path,
        "evaluate",
        StageCounts(4, 4),
        status="ok",
        mean_acceptance_length={"0": 1.75},
        acceptance_rate={"0": 0.25},
        untrained_mean_acceptance_length={"0": 1.0},
        offline_acceptance_length=1.6,
    )
    (tmp_path / "generations").mkdir()
    text = write_report(tmp_path).read_text()
    assert (
        "| prepare | ok | 5 | 3 | 0 | 2 | empty=2 |" in text and "| generate | ok | 3 | 2 | 1 | 0 | timeout=1 |" in text
    )
    assert "300 tokens in 2 samples" in text and "200 supervised (66.7%), 1 rows truncated" in text
    assert (
        "| 0 | 1.750 | 0.250 | 1.000 |" in text
        and "Offline estimate from training (held-out, greedy chain): 1.600" in text
    )
    assert f"`{tmp_path / 'generations/'}`" in text or f"`{tmp_path / 'generations'}`" in text


def test_a_prefect_api_url_where_no_prefect_api_answers_is_one_line_naming_it(tmp_path):
    """PREFECT_API_URL at a closed port, or at an HTTP server that is not Prefect's API: one line naming
    the URL (cli/prefect_auth.py's check, before any flow run), not a traceback, nor the line of a server
    lost mid-run (cli/prefect_client.py), since nothing started. The two commands run at once."""
    import functools
    import http.server
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/api"

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=other.serve_forever, daemon=True).start()
    not_prefect = f"http://127.0.0.1:{other.server_address[1]}/api"
    try:
        procs = {
            url: subprocess.Popen(
                [*EAGLE3, "generate", "--config", str(DEMO_RECIPE)],
                env={**os.environ, "PREFECT_API_URL": url},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for url in (closed, not_prefect)
        }
        out = {url: p.communicate(timeout=300) for url, p in procs.items()}
    finally:
        other.shutdown()
        other.server_close()
    for url, (_, err) in out.items():
        assert procs[url].returncode == 1, err[-2000:]
        assert "Traceback" not in err and "lost the Prefect server" not in err, err[-2000:]
        assert len(err.strip().splitlines()) == 1, err[-2000:]
    refused = out[closed][1]
    assert refused.startswith(f"eagle3 generate: error: no Prefect server answered at PREFECT_API_URL={closed} (")
    assert "ConnectError" in refused
    assert out[not_prefect][1].startswith(
        f"eagle3 generate: error: PREFECT_API_URL={not_prefect} answered 404 Not Found to GET {not_prefect}/hello: "
    )


def test_an_unusable_prefect_credential_file_fails_in_one_line_naming_it(tmp_path):
    """PREFECT_API_AUTH_STRING_FILE (cli/prefect_auth.py) is read before anything else; a missing or empty
    file is one line naming the variable and the path (the 401/200 checks: tests/integration/test_prefect_auth.py)."""
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.write_text("\n")
    for path, why in ((missing, "cannot read it (No such file or directory)"), (empty, "the file is empty")):
        result = run("generate", "--config", str(DEMO_RECIPE), env={"PREFECT_API_AUTH_STRING_FILE": str(path)})
        assert result.returncode == 1, result.stderr[-2000:]
        assert f"eagle3 generate: error: PREFECT_API_AUTH_STRING_FILE={path}: {why}" in result.stderr
        assert "Traceback" not in result.stderr
