"""Flow ``eagle3-tokenize``: a task per generation shard, then the stage summary."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.progress import report
from tasks.tokenize import shard_names, tokenize_shard_task, tokenize_summary_task


@flow(name="eagle3-tokenize", description="Input ids and loss masks per generation shard, as Parquet.")
def tokenize_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    calls = [
        (tokenize_shard_task.with_options(name=f"tokenize-{s.removesuffix('.parquet')}"), (config, s))
        for s in shard_names(config)
    ]
    if config.cluster.runs("tokenize"):
        from flows.cluster import run_shards

        results = run_shards(config, "tokenize", calls, cpus=config.cluster.tokenize_cpus)
    else:
        results = []
        for task, args in calls:
            report("tokenize", "shards", len(results), len(calls), unit="shards")
            results.append(task(*args))
    report("tokenize", "shards", len(results), len(calls), unit="shards")
    return tokenize_summary_task(config, results)
