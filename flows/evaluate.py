"""Flow ``eagle3-evaluate``: the exported drafter's speed and acceptance measured live in vLLM, next to the
alternatives."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from tasks.evaluate import evaluate_task


@flow(
    name="eagle3-evaluate",
    description=(
        "Serve the target without speculation, with vLLM's n-gram speculator, an untrained and the trained EAGLE-3 "
        "drafter; measure decode tokens/s and acceptance on labelled prompt sets per temperature and concurrency."
    ),
)
def evaluate_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)  # every server serves the target's folder they name
    return evaluate_task(facts)
