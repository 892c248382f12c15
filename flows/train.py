"""Flow ``eagle3-train``: the drafter trained with torchrun on the run's shards."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from tasks.train import train_report_task, train_task


@flow(
    name="eagle3-train",
    description="Train the EAGLE-3 drafter (torchrun: DDP or FSDP; resumes from its last checkpoint).",
)
def train_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)
    entry = train_task(facts, facts.shard_names("train"))
    return train_report_task(config, entry)
