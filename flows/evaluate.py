"""Flow ``eagle3-evaluate``: the exported drafter's acceptance measured live in vLLM."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from tasks.evaluate import evaluate_task


@flow(name="eagle3-evaluate", description="Serve the target with the exported EAGLE-3 drafter and measure acceptance on held-out prompts at each temperature.")
def evaluate_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    return evaluate_task(config)
