"""Flow ``eagle3-pipeline``: every stage of ``eagle3.stages`` (or those through ``until``), in order, as
subflows, then the run report.

The run's facts (eagle3/run_facts.py) are resolved once here, unless the caller (the CLI) resolved
them, and each stage's flow gets them as its ``facts`` parameter. Each stage also runs alone through
its own flow (``eagle3 STAGE``, or its deployment), which then resolves them itself.
"""

from __future__ import annotations

import datetime
import inspect

from prefect import flow
from prefect.runtime import flow_run

from eagle3 import progress, stages
from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from flows.api import api_answers
from tasks.report import report_task


async def run_stages(config: PipelineConfig, todo: tuple[stages.Stage, ...], facts: RunFacts) -> dict:
    """Each stage's flow in order, given the run's facts (awaited when it is async); its result under its name."""
    results: dict = {}
    for stage in todo:
        await api_answers()  # a sync stage flow starts on fresh Prefect clients (flows/api.py)
        outcome = stages.resolve(stage.flow)(config, facts)
        results[stage.name] = await outcome if inspect.isawaitable(outcome) else outcome
        progress.finish(stage.name)
    return results


def run_name() -> str:
    """'<model>-<UTC date and time>', so the runs list says what each run is."""
    config = flow_run.parameters.get("config")
    model = (
        config.server.model
        if isinstance(config, PipelineConfig)
        else (config or {}).get("server", {}).get("model", "tiny:qwen3")
    )
    short = model.rstrip("/").split("/")[-1].replace(":", "-")
    return f"{short}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M}"


@flow(
    name="eagle3-pipeline",
    flow_run_name=run_name,
    description="Prompts to a trained, exported and live-evaluated EAGLE-3 drafter.",
)
async def pipeline_flow(
    config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None, until: str | None = None
) -> dict:
    """Every stage in order, or through the stage ``until`` names (a later run without it resumes there:
    the finished stages find their work on disk), then the run report."""
    from eagle3.cluster import precheck
    from eagle3.reasoning import check_config

    todo = stages.up_to(until)  # an unknown name fails here, listing the stages
    check_config(config)  # a reasoning mode the chat template cannot express fails before any stage runs
    precheck(config, [s.name for s in todo])  # so does a cluster address nobody answers at
    results = await run_stages(config, todo, RunFacts.of(config, facts))
    await api_answers()  # a sync task: fresh Prefect clients
    results["report"] = report_task(config)
    return results
