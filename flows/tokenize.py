"""Flows ``eagle3-tokenize`` (a task per shard) and ``eagle3-vocab``."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from tasks.tokenize import shard_names, tokenize_shard_task, tokenize_summary_task, vocab_task


@flow(name="eagle3-tokenize", description="Input ids and loss masks per generation shard, as Parquet.")
def tokenize_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    results = [
        tokenize_shard_task.with_options(name=f"tokenize-{s.removesuffix('.parquet')}")(config, s)
        for s in shard_names(config)
    ]
    return tokenize_summary_task(config, results)


@flow(name="eagle3-vocab", description="The draft vocabulary (d2t, t2d) from supervised-token counts.")
def vocab_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    return vocab_task(config, shard_names(config))
