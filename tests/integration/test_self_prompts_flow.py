"""The prepare flow with data.source = "self:prompts": it serves the target (managed: the fake started as
"vLLM"; external: the fake attached to), writes the prompts, and hands the normal prepare contract on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import PYTHON, ROOT
from fake_openai import FakeConfig, run_fake_server
from test_server_faults import FAKE_AS_VLLM

pytestmark = pytest.mark.integration
SCRIPT = [f"Please explain topic number {k} ({k * 7919 % 997}) in simple words." for k in range(64)]
SETS = (
    'data.source="self:prompts"',
    "data.self_prompts.count=12",
    "data.self_prompts.n=4",
    "data.num_shards=2",
    'server.model="tiny:qwen3"',
    'server.served_model_name="fake-target"',
    "data.self_prompts.near_duplicate_threshold=1.0",
)


def stages(config) -> dict:
    return json.loads((Path(config.run_dir) / "manifest.json").read_text())["stages"]


def assert_prepare_contract(config) -> None:
    run = Path(config.run_dir)
    rows = [r for s in sorted((run / "prompts").glob("shard-*.parquet")) for r in pq.read_table(s).to_pylist()]
    entry = stages(config)
    assert len(rows) == entry["self_prompts"]["ok"] == entry["prepare"]["ok"] == 12
    assert all(set(r) == {"id", "messages", "source_index"} and r["messages"][0]["role"] == "user" for r in rows)
    assert {r["messages"][0]["content"] for r in rows} <= set(SCRIPT)


def test_managed_server_is_started_for_the_prompts_and_not_again_on_a_rerun(prefect_server, demo_config, tmp_path):
    from flows.prepare import prepare_flow

    wrapper = tmp_path / "fake_as_vllm.py"
    wrapper.write_text(FAKE_AS_VLLM.format(tests=str(ROOT / "tests")))
    fake_cfg = tmp_path / "fake.json"
    fake_cfg.write_text(json.dumps({"completion_script": SCRIPT}))
    config = demo_config(
        *SETS,
        f'server.command=["{PYTHON}", "{wrapper}"]',
        f'server.args=["--fake-config-file", "{fake_cfg}"]',
        'server.reasoning_parser=""',
        "server.startup_timeout_s=30",
        "server.stop_grace_s=5",
    )
    assert prepare_flow(config, return_state=True).is_completed()
    assert_prepare_contract(config)
    log = Path(config.run_dir) / "prompts" / "server.log"
    assert log.read_text().count("FAKE-PID") == 1 and not (Path(config.run_dir) / "generations").exists()
    assert prepare_flow(config, return_state=True).is_completed()
    assert log.read_text().count("FAKE-PID") == 1, "prompts on disk match the settings: no server on a rerun"


def test_external_server_is_attached_to(prefect_server, demo_config, monkeypatch):
    from flows.prepare import prepare_flow

    with run_fake_server(FakeConfig(completion_script=SCRIPT)) as srv:
        config = demo_config(*SETS, 'server.mode="external"', f'server.urls=["{srv.base_url}"]')
        assert prepare_flow(config, return_state=True).is_completed()
        assert srv.stats()["completed"] == 3  # 12 distinct prompts at 4 per request
    assert_prepare_contract(config)
