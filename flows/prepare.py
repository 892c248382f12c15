"""Flow ``eagle3-prepare``: prompts from the configured source into Parquet shards.

With ``data.source = "self:prompts"`` the target writes the prompts first: the flow starts
(managed) or attaches to (external) the target's server through the same serving code as
generation, unless the prompts on disk already match the settings.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.utilities.asyncutils import run_coro_as_sync

from eagle3.config import PipelineConfig
from eagle3.layout import RunLayout
from eagle3.prepare.self_prompts import Plan, is_self_source, marker_current
from eagle3.prepare.stage import PrepareResult
from eagle3.run_facts import RunFacts
from eagle3.serving.target import target_server
from tasks.prepare import prepare_task, self_prompts_plan_task, self_prompts_task


async def _written_by_target(config: PipelineConfig, plan: Plan) -> dict | None:
    async with target_server(config, get_run_logger(), folder="prompts") as serving:
        entry = await serving.run(self_prompts_task(config, serving.target, plan))
    serving.raise_if_lost(config)
    return entry


@flow(
    name="eagle3-prepare",
    description="Load, normalise, de-duplicate and shard the prompts (or have the target write them).",
)
def prepare_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> PrepareResult:
    facts = RunFacts.of(config, facts)  # self-prompts read the target's folder (its chat template) through them
    if is_self_source(config.data.source):
        plan = self_prompts_plan_task(facts)
        if marker_current(config, plan) is None:
            # A sync flow (its callers, deployments and tests call it so): the server and the requests
            # are async, so they run on an event loop of their own thread.
            run_coro_as_sync(_written_by_target(config, plan), force_new_thread=True)
        else:
            get_run_logger().info(
                "self_prompts: %s matches these settings; no server started",
                RunLayout.of(config).self_prompts_file,
            )
    return prepare_task(config)
