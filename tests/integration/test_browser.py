"""The Prefect UI as a user sees it, in headless Chromium (Debian's package) driven by Playwright.

A small pipeline run against a real `prefect server start`: prepare, then generation through the
fault-injecting fake server where one prompt fails until its shard task's Prefect retry, then the
run report. The test then opens the pages a user would: the flow run, its task runs, the retried
task run (run count 2) and the report artifact."""

import json
import shutil
import subprocess
import sys
import textwrap

import httpx
import pytest

from conftest import ROOT
from prefect_server import Server

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

RUN_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    sys.path[:0] = [{tests!r}]
    from prefect import flow
    from eagle3.config import DEMO_RECIPE, load_config
    from fake_openai import FakeConfig, FaultRule, run_fake_server
    from flows.generate import generate_flow
    from flows.prepare import prepare_flow
    from tasks.report import report_task

    @flow(name="eagle3-browser-check")
    async def small_pipeline(config):
        prepare_flow(config)
        await generate_flow(config)
        return report_task(config)

    src, run = sys.argv[1], sys.argv[2]
    rule = FaultRule(match="please retry me", kind="status", status=503, times=3)
    with run_fake_server(FakeConfig(rules=[rule])) as fake:
        config = load_config(
            DEMO_RECIPE,
            [
                f'run_dir="{{run}}"', f'data.source="{{src}}"', "data.num_shards=2", 'server.mode="external"',
                'server.model="fake-target"', f'server.urls=["{{fake.base_url}}"]', "generation.max_attempts=2",
                "generation.backoff_base_s=0.05", "generation.backoff_max_s=0.1", "generation.shard_retry_delay_s=0",
            ],
        )
        state = asyncio.run(small_pipeline(config, return_state=True))
    print(json.dumps({{"flow_run_id": str(state.state_details.flow_run_id), "state": state.type.value}}))
""")


def api(server: Server, path: str, body: dict | None = None):
    r = (
        httpx.post(f"{server.api}{path}", json=body or {}, timeout=10)
        if body is not None
        else httpx.get(f"{server.api}{path}", timeout=10)
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not shutil.which("chromium") and not shutil.os.path.exists(CHROMIUM),
    reason="Debian's chromium is not installed (apt-get install chromium)",
)
def test_a_user_sees_the_run_its_task_runs_the_retry_and_the_report_in_the_ui(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    src = tmp_path / "prompts.jsonl"
    prompts = ["please retry me"] + [f"ordinary question {i}" for i in range(9)]
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    server = Server(tmp_path / "prefect")
    try:
        out = subprocess.run(
            [sys.executable, "-c", RUN_SCRIPT.format(tests=str(ROOT / "tests")), str(src), str(tmp_path / "run")],
            env=server.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["state"] == "COMPLETED"
        parent = result["flow_run_id"]
        children = api(server, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent]}}})
        generate = next(r for r in children if api(server, f"/flows/{r['flow_id']}")["name"] == "eagle3-generate")
        tasks = api(server, "/task_runs/filter", {"flow_runs": {"id": {"any_": [generate["id"]]}}})
        retried = next(t for t in tasks if t["name"].startswith("generate-shard") and t["run_count"] == 2)
        report = next(
            a for a in api(server, "/artifacts/filter", {"artifacts": {"key": {"any_": ["pipeline-report"]}}})
        )
        ui = server.api.removesuffix("/api")

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                ],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})

            page.goto(f"{ui}/runs/flow-run/{parent}")
            expect(page.get_by_text("eagle3-browser-check").first).to_be_visible(timeout=30_000)
            expect(page.get_by_text("Completed").first).to_be_visible(timeout=30_000)
            page.screenshot(path=str(tmp_path / "flow-run.png"))

            page.goto(f"{ui}/runs/flow-run/{generate['id']}")
            page.get_by_text("Task Runs", exact=True).first.click()
            for t in tasks:
                expect(page.get_by_text(t["name"]).first).to_be_visible(timeout=30_000)
            page.screenshot(path=str(tmp_path / "task-runs.png"))

            page.goto(f"{ui}/runs/task-run/{retried['id']}")
            expect(page.get_by_text(retried["name"]).first).to_be_visible(timeout=30_000)
            count = page.get_by_text("Run Count").first  # in the details panel beside the logs on a wide window
            if not count.is_visible():
                page.get_by_text("Details", exact=True).first.click()
            expect(count).to_be_visible(timeout=30_000)
            expect(count.locator("xpath=..")).to_contain_text("2")
            page.screenshot(path=str(tmp_path / "retried-task.png"))

            page.goto(f"{ui}/artifacts/artifact/{report['id']}")
            expect(page.get_by_text("Accounting").first).to_be_visible(timeout=30_000)
            expect(page.get_by_text("Where everything is").first).to_be_visible()
            page.screenshot(path=str(tmp_path / "report.png"))
            browser.close()
    finally:
        server.stop()
