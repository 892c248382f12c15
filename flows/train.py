"""Flow ``eagle3-train``: the drafter trained with torchrun on the run's shards."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from tasks.tokenize import shard_names
from tasks.train import train_report_task, train_task


@flow(
    name="eagle3-train",
    description="Train the EAGLE-3 drafter (torchrun: DDP or FSDP; resumes from its last checkpoint).",
)
def train_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    entry = train_task(config, shard_names(config))
    return train_report_task(config, entry)
