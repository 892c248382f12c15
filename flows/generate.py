"""Flow ``eagle3-generate``: the target's server around one task per prompt shard."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefect import flow, get_run_logger

from eagle3.config import PipelineConfig
from eagle3.generate import stage
from eagle3.generate.shard import is_complete
from tasks.generate import generate_shard_task, generate_summary_task
from tasks.serve import expected_target, target_server


async def _bounded(limit: asyncio.Semaphore, make):
    async with limit:
        return await make()


@flow(name="eagle3-generate", description="Regenerate every prompt's answer with the target, durably and resumably.")
async def generate_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    gen = config.generation
    shards = stage.prepared_shards(config)
    parallel = min(gen.shard_parallelism, len(shards))
    per_shard = max(1, gen.concurrency // parallel)
    limit = asyncio.Semaphore(parallel)
    model, template = expected_target(config)
    out = Path(config.run_dir) / "generations"
    if shards and all(is_complete(s, out, gen, model, template) for s in shards):
        # A nightly run with no new or changed prompt: no server start, no request.
        get_run_logger().info("generate: all %d shards complete on disk for this model, sampling and template; no server started", len(shards))
        return generate_summary_task(config, [str(s) for s in shards], model)
    async with target_server(config, get_run_logger()) as target:
        runs = [
            _bounded(limit, lambda s=s: generate_shard_task.with_options(
                name=f"generate-{s.stem}", timeout_seconds=stage.shard_timeout_s(rows, per_shard, gen),
                retries=gen.shard_retries, retry_delay_seconds=gen.shard_retry_delay_s,
            )(config, str(s), target, per_shard))
            for s, rows in shards.items()
        ]
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
    entry = generate_summary_task(config, [str(s) for s in shards], target.model)
    crashed = [o for o in outcomes if isinstance(o, BaseException)]
    if crashed:
        raise crashed[0]
    return entry
