"""Prefect tasks for stage ``generate``: one task per prompt shard, and the stage summary."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from pydantic import SecretStr

from eagle3.config import PipelineConfig
from eagle3.errors import TransientError
from eagle3.generate import stage
from eagle3.generate.shard import ShardResult, generate_shard
from eagle3.progress import report
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool, deadline_s
from eagle3.serving.target import Target, outage_wait_s, replica_events
from tasks import progress_artifacts


class ShardIncomplete(TransientError, RuntimeError):
    """Some prompts of the shard failed with transient errors; a retry resumes them."""


def _progress_line(name: str, s: dict) -> str:
    return (
        f"{name}: samples done {s['done']}+{s['skipped']} on disk / {s['total']}, failed {s['failed']}, filtered "
        f"{s['filtered']}, in flight {s['in_flight']}, {s['req_per_s']} req/s, {s['tokens_per_s']} tok/s, mean "
        f"completion {s['mean_completion_tokens']} tokens, retries {s['retries'] or '{}'}"
    )


# The disk marker (input hash + generation key) decides whether a shard is done, so
# Prefect's cache is off: a cached result could claim a shard whose files were deleted.
# Retries and their delay are set per run from generation.shard_retries / shard_retry_delay_s.
@task(name="generate-shard", cache_policy=NO_CACHE)
async def generate_shard_task(
    facts: RunFacts, shard: str, target: Target, concurrency: int, key: SecretStr | None = None
) -> ShardResult:
    """``key``: the server's API key where this task runs away from the flow's process (a Ray worker); on
    the flow's machine it is None and the key is read from the variable ``target.key_env`` names."""
    logger = get_run_logger()
    config = facts.config
    gen = config.generation
    artifact = await progress_artifacts.astart(f"generate {Path(shard).name}", logger)
    pending: set[asyncio.Task] = set()

    def progress(snap: dict) -> None:
        logger.info(_progress_line(Path(shard).name, snap))
        finished = snap["done"] + snap["skipped"] + snap["failed"] + snap["filtered"]
        report("generate", Path(shard).name, finished, snap["total"], snap["failed"], unit="samples")
        job = asyncio.ensure_future(
            progress_artifacts.aupdate(artifact, 100.0 * finished / max(1, snap["total"]), logger)
        )
        pending.add(job)
        job.add_done_callback(pending.discard)

    pool = EndpointPool(
        list(target.urls),
        key.get_secret_value() if key is not None else os.environ.get(target.key_env),
        concurrency,
        deadline_s(gen),
        outage_wait_s=outage_wait_s(config),
        logger=logger,
        events=replica_events(config),
    )
    for url, why in target.down_at_start:
        pool.bench(url, f"did not answer when the run began ({why})")
    try:
        result = await generate_shard(
            shard,
            stage.out_dir(config),
            gen,
            target.model,
            pool,
            target.template_hash,
            logger=logger,
            progress=progress,
            concurrency=concurrency,
            **facts.request_plan,
        )
    finally:
        await pool.close()
        for job in pending:  # superseded by the last update below; one waiting on a lost Prefect server ends now
            job.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pool.benched:
            logger.warning(
                "%s: servers benched after refusing or dropping connections (times): %s",
                Path(shard).name,
                dict(pool.benched),
            )
    await progress_artifacts.aupdate(artifact, 100.0, logger)
    if not result.complete and task_run.run_count <= gen.shard_retries:
        raise ShardIncomplete(
            f"{result.shard}: {result.retryable} samples failed with transient errors ({result.errors}); "
            "retrying resumes them"
        )
    return result


@task(name="generate-summary", cache_policy=NO_CACHE)
def generate_summary_task(config: PipelineConfig, shards: list[str], model: str, server: dict | None = None) -> dict:
    summary = stage.summarize(config, [Path(s) for s in shards])
    rows = [{"error kind": k, "prompts": n} for k, n in sorted(summary["errors"].items(), key=lambda kv: -kv[1])]
    create_table_artifact(
        key="generate-errors",
        table=rows or [{"error kind": "none", "prompts": 0}],
        description=(
            f"generate: ok {summary['ok']}, filtered {summary['filtered']}, failed {summary['failed']} of "
            f"{summary['in']}"
        ),
    )
    return stage.record(config, summary, model, server)
