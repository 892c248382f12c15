"""Flow ``eagle3-tokenize``: a task per generation shard, then the stage summary."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.progress import report
from eagle3.run_facts import RunFacts
from tasks.tokenize import tokenize_shard_task, tokenize_summary_task


@flow(name="eagle3-tokenize", description="Input ids and loss masks per generation shard, as Parquet.")
def tokenize_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)
    calls = [
        (tokenize_shard_task.with_options(name=f"tokenize-{s.removesuffix('.parquet')}"), (facts, s))
        for s in facts.shard_names("tokenize")
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
    return tokenize_summary_task(facts, results)
