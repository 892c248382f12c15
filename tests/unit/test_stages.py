"""The stage registry (eagle3/stages.py) drives the CLI, the parent and nightly flows and the report
(the import graph's layers, which read it too: test_import_graph.py)."""

import ast
import asyncio
import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import DEMO_RECIPE, ROOT
from eagle3 import stages
from eagle3.config import load_config
from eagle3.manifest import record_stage
from eagle3.results import StageCounts

CALLS: list[str] = []


def dummy_flow(config, facts=None):
    """A stage's flow, as small as one can be: it records itself in the manifest and writes its output."""
    CALLS.append("dummy")
    out = Path(config.run_dir) / "dummy"
    out.mkdir(parents=True, exist_ok=True)
    (out / "done.json").write_text("{}")
    return record_stage(config.run_dir, "dummy", StageCounts(3, 2, 1, 0), status="ok", answer=42)


def dummy_summary(entry, run_dir):
    return f"dummy:        answer {entry['answer']}"


def quick_flow(config, facts=None):
    CALLS.append("quick")
    return {"stage": "quick"}


DUMMY = stages.Stage(
    name="dummy",
    summary="a stage that only a test declares",
    reads=("prepare",),
    output="dummy",
    outputs_doc="what the dummy stage wrote",
    marker="dummy/done.json",
    package="eagle3.stages",
    flow=f"{__name__}:dummy_flow",
    summary_line=f"{__name__}:dummy_summary",
    nightly=True,
    reads_model="never",
)


@pytest.fixture
def with_dummy(monkeypatch):
    CALLS.clear()
    prepare = stages.get("prepare")
    registry = (*stages.STAGES, DUMMY)
    monkeypatch.setattr(stages, "STAGES", registry)
    return prepare


def test_every_reference_in_the_registry_resolves_and_flows_are_named_after_their_stage():
    for stage in stages.STAGES:
        __import__(stage.package)
        flow = stages.resolve(stage.flow)
        assert flow.name == f"eagle3-{stage.name}", stage.name
        assert callable(stages.resolve(stage.summary_line)), stage.name
        if stage.precheck:
            assert callable(stages.resolve(stage.precheck)), stage.name
    assert stages.manifest_order()[:2] == ("self_prompts", "prepare")


def test_the_registry_refuses_a_duplicate_and_a_stage_reading_a_later_one():
    with pytest.raises(ValueError, match="declared twice"):
        stages.check((*stages.STAGES, stages.STAGES[0]))
    early = replace(DUMMY, reads=("train",))
    with pytest.raises(ValueError, match=r"reads \['train'\], which are not declared before it"):
        stages.check((stages.STAGES[0], early))
    with pytest.raises(KeyError, match="no stage named 'nope'; the stages are prepare, generate"):
        stages.get("nope")


def test_a_new_stage_is_a_cli_subcommand_with_its_help(with_dummy):
    from cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["dummy"]).command == "dummy"
    out = io.StringIO()
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):
        parser.parse_args(["--help"])
    assert "a stage that only a test declares (flow eagle3-dummy)" in out.getvalue()


def test_a_new_stage_runs_alone_from_the_cli_and_prints_its_summary_line(with_dummy, tmp_path):
    from cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["dummy", "--config", str(DEMO_RECIPE), "--set", f'run_dir="{tmp_path / "run"}"'])
    assert code == 0 and CALLS == ["dummy"]
    text = out.getvalue()
    assert "dummy:        answer 42" in text
    assert "dummy" in text.split("\n")[3], "the status table shows the new stage's accounting"


def test_the_parent_flow_runs_every_registered_stage_in_order(monkeypatch, tmp_path):
    import flows.pipeline as pipeline

    CALLS.clear()
    quick = replace(DUMMY, name="quick", flow=f"{__name__}:quick_flow", reads=(), nightly=False)
    monkeypatch.setattr(stages, "STAGES", (quick, replace(DUMMY, reads=("quick",))))
    monkeypatch.setattr(pipeline, "report_task", lambda config: "report.md")
    config = load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"'])
    results = asyncio.run(pipeline.pipeline_flow.fn(config))
    assert CALLS == ["quick", "dummy"]
    assert list(results) == ["quick", "dummy", "report"]
    assert results["dummy"]["answer"] == 42


def test_the_parent_flow_stops_after_the_stage_until_names_and_a_misspelt_one_lists_the_stages(monkeypatch, tmp_path):
    """`eagle3 run --until STAGE`: the stages through STAGE, then the report; the command line refuses an
    unknown name before anything runs (the kill matrix runs --until export and --until train for real)."""
    import flows.pipeline as pipeline
    from cli.main import build_parser

    CALLS.clear()
    quick = replace(DUMMY, name="quick", flow=f"{__name__}:quick_flow", reads=(), nightly=False)
    monkeypatch.setattr(stages, "STAGES", (quick, replace(DUMMY, reads=("quick",))))
    monkeypatch.setattr(pipeline, "report_task", lambda config: "report.md")
    config = load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"'])
    results = asyncio.run(pipeline.pipeline_flow.fn(config, until="quick"))
    assert CALLS == ["quick"] and list(results) == ["quick", "report"]
    with pytest.raises(stages.UnknownStage, match="no stage named 'dumy'; the stages are quick, dummy"):
        asyncio.run(pipeline.pipeline_flow.fn(config, until="dumy"))
    assert CALLS == ["quick"], "nothing ran"
    monkeypatch.undo()
    assert build_parser().parse_args(["run", "--until", "export"]).until == "export"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", "--until", "exprot"])
    assert exit_.value.code == 2 and "argument --until: invalid choice: 'exprot'" in err.getvalue()


def test_the_nightly_flow_runs_the_nightly_stages_only(monkeypatch, tmp_path):
    import flows.regenerate as regenerate

    CALLS.clear()
    quick = replace(DUMMY, name="quick", flow=f"{__name__}:quick_flow", reads=(), nightly=False)
    monkeypatch.setattr(stages, "STAGES", (quick, replace(DUMMY, reads=("quick",))))
    config = load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"'])
    assert list(asyncio.run(regenerate.regenerate_flow.fn(config))) == ["dummy"]
    assert CALLS == ["dummy"]
    assert [s.name for s in stages.nightly()] == ["dummy"]


def test_the_report_orders_and_locates_a_new_stage_by_the_registry(with_dummy, tmp_path):
    from eagle3.report import markdown_report, status_rows

    run = tmp_path / "run"
    config = load_config(DEMO_RECIPE, [f'run_dir="{run}"'])
    dummy_flow(config)  # recorded first ...
    record_stage(run, "prepare", StageCounts(5, 5))  # ... but the registry puts prepare before it
    assert [r["stage"] for r in status_rows(run)] == ["prepare", "dummy"]
    report = markdown_report(run)
    assert "| dummy | ok | 3 | 2 | 1 | 0 |" in report
    assert f"- `{run / 'dummy'}` -- what the dummy stage wrote" in report


def test_the_kill_matrix_kills_every_registered_stage_but_the_exempt_ones():
    source = (ROOT / "tests" / "integration" / "test_kill_matrix.py").read_text()
    tree = ast.parse(source)
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if hasattr(t, "id")}
    assert {"NOT_KILLED", "STAGES"} <= assigned
    assert "stages.names()" in source, "the kill matrix derives its stages from the registry"
    triggers = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "triggers")
    keyed = {k.value for n in ast.walk(triggers) if isinstance(n, ast.Dict) for k in n.keys}
    exempt = {
        k.value
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "NOT_KILLED"
        for k in n.value.keys
    }
    assert keyed | exempt == set(stages.names()), "every stage has a kill trigger or a written reason not to"
