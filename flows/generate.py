"""Flow ``eagle3-generate``: the target's server around one task per prompt shard."""

from __future__ import annotations

import asyncio
import os

from prefect import flow, get_run_logger
from pydantic import SecretStr

from eagle3.config import PipelineConfig
from eagle3.durable import DiskWriteError
from eagle3.generate import stage
from eagle3.generate.shard import is_complete
from eagle3.run_facts import RunFacts
from eagle3.schemas import SchemaError
from eagle3.serving.target import outage_allowance_s, target_server
from flows.api import api_answers
from tasks.generate import generate_shard_task, generate_summary_task
from tasks.retry import unless_permanent


async def _bounded(limit: asyncio.Semaphore, make):
    async with limit:
        return await make()


@flow(name="eagle3-generate", description="Regenerate every prompt's answer with the target, durably and resumably.")
async def generate_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)
    gen = config.generation
    shards = facts.prompt_shards()
    parallel = min(gen.shard_parallelism, len(shards))
    per_shard = max(1, gen.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)
    model, template = facts.expected_target()
    out = stage.out_dir(config)
    plan = facts.request_plan
    if shards and all(is_complete(s, out, gen, model, template, **plan) for s in shards):
        # A nightly run with no new or changed prompt: no server start, no request.
        get_run_logger().info(
            "generate: all %d shards complete on disk for this model, sampling and template; no server started",
            len(shards),
        )
        await api_answers()  # the summary is a sync task: fresh Prefect clients (flows/api.py)
        return generate_summary_task(config, [str(s) for s in shards], model)
    async with target_server(config, get_run_logger()) as serving:
        target = serving.target
        calls = [
            (
                generate_shard_task.with_options(
                    name=f"generate-{s.stem}",
                    timeout_seconds=stage.shard_timeout_s(rows, per_shard, gen) + outage_allowance_s(config),
                    retries=gen.shard_retries,
                    retry_delay_seconds=gen.shard_retry_delay_s,
                    retry_condition_fn=unless_permanent,
                ),
                (facts, str(s), target, per_shard),
            )
            for s, rows in shards.items()
        ]
        if config.cluster.runs("generate"):
            from flows.cluster import run_shards_async

            # The API key is a call argument (Ray's object store), as eagle3/cluster/serve.py hands it to the
            # replicas: neither a runtime_env (Ray's task records show it) nor a Prefect parameter (the API keeps
            # no task's arguments; SecretStr masks it in any repr). A local task reads target.key_env instead.
            key = SecretStr(os.environ[target.key_env]) if os.environ.get(target.key_env) else None
            calls = [(task, (*args, key)) for task, args in calls]
            work = run_shards_async(config, "generate", calls, cpus=config.cluster.generate_cpus)
        else:
            runs = [_bounded(limit, lambda t=t, a=a: t(*a)) for t, a in calls]
            work = asyncio.gather(*runs, return_exceptions=True)
        # A managed server that is gone for good (past server.max_restarts) cancels the shards
        # at once: waiting out server.outage_wait_s for a server nobody restarts helps no one.
        outcomes = await serving.run(work) or []
    # The accounting is written first (what is on disk stays counted), then the server's fate decides.
    await api_answers()  # the summary is a sync task: fresh Prefect clients (flows/api.py)
    try:
        entry = generate_summary_task(config, [str(s) for s in shards], target.model, serving.manifest_fields())
    except Exception as summary_error:
        serving.raise_if_lost(config, summary_error)
        # A full disk or a malformed prompt shard stops its shard; say that, not only "shard incomplete".
        cause = next((o for o in outcomes if isinstance(o, (DiskWriteError, SchemaError))), None)
        if cause is not None:
            raise cause from summary_error
        raise
    serving.raise_if_lost(config)
    crashed = [o for o in outcomes if isinstance(o, BaseException)]
    if crashed:
        raise crashed[0]
    return entry
