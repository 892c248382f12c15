"""The error hierarchy (eagle3/errors.py) is the one place that says whose fix an error is and whether
a retry can help: every error class of the project sits in it, the CLI and the retry policy read it."""

import importlib
import inspect
import pickle
import pkgutil
import re
from pathlib import Path

import pytest

import eagle3
from conftest import DEMO_RECIPE, ROOT
from eagle3.errors import (
    Eagle3Error,
    InputError,
    MissingInputError,
    PermanentError,
    TransientError,
    UserError,
    is_permanent,
    run_first,
)

# Modules the pipeline never imports: they run in the vLLM venv, which has no eagle3 package (a worker's
# error reaches the pipeline as its last stderr line, raised there as VllmExtractError).
OUTSIDE = {"eagle3.extract.vllm_worker", "eagle3.extract.vllm_connector"}
# Classes whose instances differ: a generation request fails transiently (timeout, 5xx) or not (400).
PER_INSTANCE = {"eagle3.serving.client.Failure", "eagle3.serving.client.StatusError"}


def _modules():
    names = [m.name for m in pkgutil.walk_packages(eagle3.__path__, "eagle3.")]
    for package in ("flows", "tasks"):
        names += [f"{package}.{p.stem}" for p in sorted((ROOT / package).glob("*.py")) if p.stem != "__init__"]
    return [n for n in names if n not in OUTSIDE]


def _error_classes():
    found = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name and cls is not Eagle3Error:
                found[f"{name}.{cls.__qualname__}"] = cls
    return found


ERROR_CLASSES = _error_classes()


def test_the_walk_finds_the_stage_errors():
    for name in (
        "eagle3.config.base.ConfigError",
        "eagle3.export.stage.MissingCheckpoint",
        "eagle3.serving.target.ServerLost",
    ):
        assert name in ERROR_CLASSES


@pytest.mark.parametrize("name", sorted(ERROR_CLASSES))
def test_every_error_class_is_placed_in_the_hierarchy(name):
    cls = ERROR_CLASSES[name]
    assert issubclass(cls, Eagle3Error), f"{name} must derive from a base in eagle3/errors.py"
    kinds = [issubclass(cls, PermanentError), issubclass(cls, TransientError)]
    if name in PER_INSTANCE:
        assert kinds == [False, False], name
    else:
        assert sum(kinds) == 1, f"{name} must be exactly one of PermanentError, TransientError"
        assert cls.transient is kinds[1]


def test_a_per_instance_failure_is_classified_by_its_flag():
    from eagle3.serving.client import Failure

    assert is_permanent(Failure("http_400", "bad request", False))
    assert not is_permanent(Failure("timeout", "no response", True))


def test_the_six_missing_input_names_are_one_type():
    from eagle3.evaluate.live import MissingInput as live_missing
    from eagle3.evaluate.prompts import MissingInput
    from eagle3.export.stage import MissingCheckpoint
    from eagle3.extract.errors import ExtractInputError
    from eagle3.run_facts import MissingInputError as facts_missing
    from eagle3.tokenize.stage import TokenizeInputError
    from eagle3.train.stage import TrainInputError

    for alias in (ExtractInputError, TrainInputError, TokenizeInputError, facts_missing, MissingInput, live_missing):
        assert alias is MissingInputError
    assert issubclass(MissingCheckpoint, MissingInputError)


def test_missing_input_names_stage_path_and_what_to_run_and_pickles(tmp_path):
    exc = MissingInputError("train", tmp_path / "vocab.safetensors", run_first("eagle3 vocab"))
    assert str(exc) == f"train: {tmp_path / 'vocab.safetensors'} not found: run `eagle3 vocab` first"
    assert (exc.stage, exc.path) == ("train", str(tmp_path / "vocab.safetensors"))
    back = pickle.loads(pickle.dumps(exc))  # task results and worker errors cross processes
    assert type(back) is MissingInputError and str(back) == str(exc)
    again = MissingInputError("extract", "x.parquet", run_first("eagle3 tokenize", again=True), "differs")
    assert str(again) == "extract: x.parquet differs: run `eagle3 tokenize` again"
    assert issubclass(MissingInputError, InputError) and issubclass(InputError, UserError)


def test_os_errors_keep_their_fields_inside_the_hierarchy():
    from eagle3.durable import DiskWriteError
    from eagle3.models import ModelDownloadError

    full = DiskWriteError(28, "/run/x: disk full")
    assert isinstance(full, OSError) and full.errno == 28 and str(full) == "/run/x: disk full"
    assert is_permanent(full) and not is_permanent(ModelDownloadError("connection reset"))


# -- the retry policy ------------------------------------------------------------------------------


def test_retry_policy_refuses_permanent_errors_and_retries_transient_ones():
    from prefect.states import Failed

    from eagle3.errors import TrainFailed
    from eagle3.serving.managed import ServerError
    from tasks.generate import ShardIncomplete
    from tasks.retry import unless_permanent

    for permanent in (MissingInputError("train", "v", "run it"), InputError("bad row"), UserError("bad key")):
        assert not unless_permanent(None, None, Failed(data=permanent)), permanent
    for transient in (ServerError("died"), TrainFailed("torchrun exited with -9"), ShardIncomplete("2 left")):
        assert unless_permanent(None, None, Failed(data=transient)), transient


def test_retry_policy_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, tasks.retry\nassert 'torch' not in sys.modules, 'torch'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


# -- the CLI ---------------------------------------------------------------------------------------


def _empty_run(tmp_path):
    from eagle3.config import load_config

    return load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"'])


def _stage_calls():
    """What each stage's flow first calls, on an empty run directory (the real library functions)."""
    from eagle3.evaluate.live import run_evaluate
    from eagle3.export.stage import run_export
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.train.stage import run_train
    from eagle3.vocab.stage import run_vocab

    shard = "shard-00000.parquet"
    return {
        "generate": lambda c, facts: facts.prompt_shards(),
        "tokenize": lambda c, facts: tokenize_shard(facts, shard, None),
        "vocab": lambda c, facts: run_vocab(facts, [shard]),
        "train": lambda c, facts: run_train(facts, [shard]),
        "export": lambda c, facts: run_export(facts),
        "evaluate": lambda c, facts: run_evaluate(facts),
    }


@pytest.fixture
def cli(monkeypatch, capsys, tmp_path):
    """cli.main in-process on an empty run directory, each stage's flow replaced by its first
    library call (no Prefect server): (exit code, stderr)."""
    from cli import main as module
    from eagle3 import stages

    monkeypatch.setattr(module, "_prefect_defaults", lambda: None)
    calls = {stages.get(stage).flow: call for stage, call in _stage_calls().items()}
    resolve = stages.resolve
    monkeypatch.setattr(stages, "resolve", lambda ref: calls.get(ref) or resolve(ref))

    def run(*args):
        code = module.main([*args, "--config", str(DEMO_RECIPE), "--set", f'run_dir="{tmp_path / "run"}"'])
        return code, capsys.readouterr().err

    return run


@pytest.mark.parametrize(
    "stage, extra, expect",
    [
        ("prepare", ["--set", "data.source=./missing.jsonl"], r"data.source './missing.jsonl'"),
        ("generate", [], r"prompts/done.json not found: run the prepare stage first"),
        ("tokenize", [], r"tokenize: .*shard-00000.done.json not found: .*run `eagle3 generate` first"),
        ("vocab", [], r"vocab: .*tokenized lacks the token counts .*run `eagle3 tokenize` first"),
        ("extract", [], r"prompts/done.json not found"),
        ("train", [], r"train: .*draft_vocab.safetensors not found: run `eagle3 vocab` first"),
        ("export", [], r"export: .*checkpoints holds no drafter checkpoint.*run `eagle3 train` first"),
        ("evaluate", [], r"evaluate: .*export/vllm holds no exported drafter: run `eagle3 export` first"),
    ],
)
def test_cli_prints_one_line_and_exits_1_for_each_stage_missing_its_input(cli, stage, extra, expect):
    code, err = cli(stage, *extra)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"eagle3 {stage}: error: ") and re.search(expect, lines[0]), lines[0]


def test_cli_prints_a_transient_error_in_one_line_and_a_bug_with_its_traceback(cli, monkeypatch):
    from eagle3 import stages
    from eagle3.serving.managed import ServerError

    export_flow, resolve = stages.get("export").flow, stages.resolve

    def export_runs(call):
        monkeypatch.setattr(stages, "resolve", lambda ref: call if ref == export_flow else resolve(ref))

    def dies(config, facts):
        raise ServerError("vllm exited with code 1 during startup; see server.log")

    def bug(config, facts):
        raise KeyError("layer_ids")

    export_runs(dies)
    code, err = cli("export")
    assert code == 1 and err.strip() == "eagle3 export: error: vllm exited with code 1 during startup; see server.log"
    export_runs(bug)
    with pytest.raises(KeyError):  # not caught: the console script prints its traceback
        cli("export")


def test_exit_codes_are_in_the_help():
    from cli.main import build_parser

    text = build_parser().format_help()
    assert "exit status:" in text and "  1  " in text and "  2  " in text


# -- messages point at files that exist ----------------------------------------------------------------

RUN_FILES = {"report.md"}  # written into a run directory, not the repository


def test_every_doc_path_named_in_the_code_exists():
    named = set()
    for package in ("eagle3", "flows", "tasks"):
        for path in (ROOT / package).rglob("*.py"):
            for token in re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_]\.md\b", path.read_text()):
                if Path(token).name not in RUN_FILES:
                    named.add((token, path.relative_to(ROOT)))
    assert named, "the code names docs/design.md in several places"
    missing = [f"{where}: {token}" for token, where in sorted(named) if not (ROOT / token).is_file()]
    assert not missing, missing
