"""Flow ``eagle3-vocab``: the draft vocabulary (d2t, t2d) from supervised-token counts."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from tasks.tokenize import shard_names
from tasks.vocab import vocab_task


@flow(name="eagle3-vocab", description="The draft vocabulary (d2t, t2d) from supervised-token counts.")
def vocab_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    return vocab_task(config, shard_names(config))
