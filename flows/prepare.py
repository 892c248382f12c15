"""Flow ``eagle3-prepare``: prompts from the configured source into Parquet shards."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.prepare.stage import PrepareResult
from tasks.prepare import prepare_task


@flow(name="eagle3-prepare", description="Load, normalise, de-duplicate and shard the prompts.")
def prepare_flow(config: PipelineConfig = PipelineConfig()) -> PrepareResult:
    return prepare_task(config)
