"""Flow ``eagle3-extract``: the target's hidden states per tokenized shard."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from tasks.extract import extract_shard_task, extract_summary_task, online_task, plan_task


@flow(
    name="eagle3-extract",
    description=(
        "The target's auxiliary and last-layer hidden states for every tokenized sample (bf16 safetensors per shard)."
    ),
)
def extract_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)
    shards = facts.shard_names("extract")
    the_plan = plan_task(facts, shards)
    if config.extract.mode == "online":
        return online_task(facts, shards, the_plan)
    if config.cluster.runs("extract"):
        from flows.cluster import run_shards

        # One task per shard, each on the GPUs one target copy needs: the cluster's GPUs bound the parallelism.
        calls = [
            (extract_shard_task.with_options(name=f"extract-{s.removesuffix('.parquet')}"), (config, s, the_plan))
            for s in shards
        ]
        c = config.cluster
        results = run_shards(config, "extract", calls, cpus=c.extract_cpus, gpus=c.extract_gpus)
        return extract_summary_task(config, results, the_plan)
    # Bounded parallelism: one shard per target replica at a time (one replica per GPU).
    replicas, results = config.extract.replicas, []
    for start in range(0, len(shards), replicas):
        wave = shards[start : start + replicas]
        futures = [
            extract_shard_task.with_options(name=f"extract-{s.removesuffix('.parquet')}").submit(config, s, the_plan, r)
            for r, s in enumerate(wave)
        ]
        results += [f.result() for f in futures]
    return extract_summary_task(config, results, the_plan)
