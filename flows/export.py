"""Flow ``eagle3-export``: the trained drafter as vLLM / SGLang / speculators checkpoints."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from tasks.export import export_task


@flow(
    name="eagle3-export",
    description=(
        "Write the best drafter checkpoint in each export.formats layout under RUN/export/ and validate each against "
        "the target."
    ),
)
def export_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)  # the target's folder and depth come from them
    return export_task(facts)
