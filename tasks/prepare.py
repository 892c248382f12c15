"""Prefect task for stage ``prepare``: unpack config, call the library, report, return a reference."""

from __future__ import annotations

import os

from prefect import get_run_logger, task
from prefect.artifacts import acreate_table_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.manifest import read_manifest
from eagle3.prepare.self_prompts import Plan, collect, make_plan
from eagle3.prepare.stage import PrepareResult, run_prepare
from eagle3.run_facts import RunFacts
from eagle3.serving.client import EndpointPool, deadline_s
from eagle3.serving.target import Target, outage_wait_s, replica_events


# The completion marker on disk decides whether work is needed (it checks the
# input fingerprint and every shard's hash), so Prefect's cache is not used here.
@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_task(config: PipelineConfig) -> PrepareResult:
    result = run_prepare(config, logger=get_run_logger())
    counts = result.counts
    rows = [{"measure": k, "value": counts[k]} for k in ("in", "ok", "failed", "filtered")]
    rows += [{"measure": f"filtered: {kind}", "value": n} for kind, n in counts["reasons"].items()]
    entry = read_manifest(config.run_dir)["stages"].get("prepare") or {}
    for source in entry.get("sources") or () if config.data.mix else ():  # a mix: each source's own accounting
        value = f"in {source['in']}, ok {source['ok']}, filtered {source['filtered']} {source['reasons'] or ''}"
        rows.append({"measure": f"source {source['name']}", "value": value})
    create_table_artifact(
        key="prepare-accounting",
        table=rows,
        description=f"prepare: {result.out_dir} ({'up to date, skipped' if result.skipped else 'built'})",
    )
    return result


@task(name="self-prompts-plan", cache_policy=NO_CACHE)
def self_prompts_plan_task(facts: RunFacts) -> Plan:
    """Where a user turn starts and ends in the target's chat template (one prefix per system prompt)."""
    plan = make_plan(facts)
    for turn in plan.prefixes:
        get_run_logger().info(
            "self_prompts: prefix %r, turn ends at %r (stop token ids %s)",
            turn.prefix,
            turn.stop,
            list(turn.stop_token_ids),
        )
    return plan


@task(name="self-prompts", cache_policy=NO_CACHE)
async def self_prompts_task(config: PipelineConfig, target: Target, plan: Plan) -> dict:
    """Ask the served target for user turns until data.self_prompts.count pass the filters."""
    logger = get_run_logger()
    sp, gen = config.data.self_prompts, config.generation
    pool = EndpointPool(
        list(target.urls),
        os.environ.get(target.key_env),
        sp.concurrency,
        deadline_s(gen.model_copy(update={"max_tokens": sp.max_tokens})),
        outage_wait_s=outage_wait_s(config),
        logger=logger,
        events=replica_events(config, "prompts"),
    )
    for url, why in target.down_at_start:
        pool.bench(url, f"did not answer when the run began ({why})")
    try:
        entry = await collect(config, plan, pool, target.model, logger)
    finally:
        await pool.close()
    rows = [
        {"measure": k, "value": entry[k]}
        for k in ("in", "ok", "failed", "filtered", "wanted", "requests_judged", "requests_asked")
    ]
    rows += [{"measure": f"filtered: {kind}", "value": n} for kind, n in entry["reasons"].items()]
    await acreate_table_artifact(
        key="self-prompts-accounting",
        table=rows,
        description=f"self-written prompts: {entry['ok']} kept of {entry['in']} samples",
    )
    return entry
