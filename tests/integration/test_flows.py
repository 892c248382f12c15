"""The prepare and pipeline flows through a real (temporary) Prefect server."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterParentFlowRunId

from conftest import PYTHON, ROOT

pytestmark = pytest.mark.integration


def test_pipeline_flow_runs_prepare_as_a_subflow(prefect_server, demo_config):
    from flows.pipeline import pipeline_flow

    config = demo_config()
    state = pipeline_flow(config, return_state=True)
    assert state.is_completed(), state
    result = state.result()["prepare"]
    assert result.counts["ok"] == 302 and not result.skipped

    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(state.state_details.flow_run_id)
        assert re.fullmatch(r"tiny-qwen3-\d{8}-\d{4}", parent.name), parent.name
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])))
        assert [client.read_flow(c.flow_id).name for c in children] == ["eagle3-prepare"]
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [children[0].id]}))
        assert [t.name.rsplit("-", 1)[0] for t in tasks] == ["prepare-prompts"]
        assert tasks[0].state.is_completed()
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prepare-accounting"])))
        assert artifacts, "the accounting table artifact is missing"
        table = artifacts[-1].data
        assert '"measure": "ok"' in table and "302" in table


def test_prepare_flow_rerun_is_skipped(prefect_server, demo_config):
    from flows.prepare import prepare_flow

    config = demo_config("data.num_shards=2")
    first = prepare_flow(config)
    second = prepare_flow(config)
    assert not first.skipped and second.skipped
    assert first.counts["ok"] == second.counts["ok"] == 302


def test_failed_stage_fails_the_flow_run(prefect_server, tmp_path):
    from eagle3.config import load_config
    from eagle3.prepare.stage import PrepareError
    from flows.prepare import prepare_flow

    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": 1}\n{"text": 2}\n')
    state = prepare_flow(load_config(None, [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"']), return_state=True)
    assert state.is_failed()
    with pytest.raises(PrepareError, match="2 of 2 candidate prompts were rejected"):
        state.result()


def test_eagle3_run_end_to_end_from_the_cli(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    result = subprocess.run(
        [PYTHON, "-m", "eagle3.cli", "run", "--set", f'run_dir="{tmp_path / "run"}"'],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prepare  ok      313  302  0       11" in result.stdout
    assert f"manifest: {tmp_path / 'run' / 'manifest.json'}" in result.stdout
    assert (Path(tmp_path) / "run" / "prompts" / "_SUCCESS.json").exists()
