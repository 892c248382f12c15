"""Prefect tasks for stage ``extract``: the plan (layer ids, disk check), one task per shard, the summary.

Nothing here imports torch: the stage module is imported inside each task.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.cluster import enter_workdir
from eagle3.config import PipelineConfig
from eagle3.progress import report
from eagle3.run_facts import RunFacts
from tasks import progress_artifacts
from tasks.retry import unless_permanent


# Disk markers keyed on the tokenized shard's hash, the model, layer ids, dtype and backend decide what is done.
@task(name="extract-plan", cache_policy=NO_CACHE)
def plan_task(facts: RunFacts, shards: list[str]):
    from eagle3.extract.stage import check_disk, plan

    the_plan = plan(facts, shards)
    check_disk(facts.config, the_plan)
    todo = [s for s, done in the_plan.done.items() if not done]
    get_run_logger().info(
        "extract: layer ids %s, hidden size %d; %d of %d shards to extract (%.2f GiB)",
        the_plan.layer_ids,
        the_plan.hidden_size,
        len(todo),
        len(shards),
        the_plan.bytes_needed / 2**30,
    )
    return the_plan


@task(name="extract-shard", cache_policy=NO_CACHE, retries=1, retry_condition_fn=unless_permanent)
def extract_shard_task(config: PipelineConfig, shard: str, the_plan, replica: int = 0):
    from eagle3.extract.stage import extract_shard

    enter_workdir()
    logger = get_run_logger()
    artifact = progress_artifacts.start(f"extract {shard}", logger)
    tokens = the_plan.tokens.get(shard, 0)

    def progress(fraction: float) -> None:
        progress_artifacts.update(artifact, 100.0 * fraction, logger)
        report("extract", shard, fraction * tokens, tokens, unit="tokens")

    result = extract_shard(config, shard, the_plan, replica, logger=logger, progress=progress)
    progress_artifacts.update(artifact, 100.0, logger)
    report("extract", shard, tokens, tokens, unit="tokens")
    return result


@task(name="extract-summary", cache_policy=NO_CACHE)
def extract_summary_task(config: PipelineConfig, results: list, the_plan) -> dict:
    from eagle3.extract.hf import release_extractors
    from eagle3.extract.stage import record

    release_extractors()
    entry = record(config, results, the_plan)
    rows = [
        {"shard": r.shard, "samples": r.ok, "tokens": r.tokens, "seconds": r.seconds, "skipped": r.skipped}
        for r in results
    ]
    create_table_artifact(
        key="extract-shards",
        table=rows,
        description=(
            f"extract ({entry['mode']}, {entry['backend']}): layer ids {entry['layer_ids']}, {entry['tokens']} "
            f"tokens, {entry['bytes'] / 2**30:.3f} GiB"
        ),
    )
    return entry


@task(name="extract-online", cache_policy=NO_CACHE)
def online_task(facts: RunFacts, shards: list[str], the_plan) -> dict:
    from eagle3.extract.stage import online_results, record, write_online

    settings = write_online(facts.config, the_plan, shards)
    get_run_logger().info(
        "extract: online mode, nothing stored; training extracts layers %s per batch", settings["layer_ids"]
    )
    return record(facts.config, online_results(facts, shards, the_plan), the_plan)
