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
    if facts is not None:  # handed down: refused when resolved for another config; alone: nothing to resolve
        RunFacts.of(config, facts)  # the stage reads only its own folders and the config; foreign facts are refused
    return export_task(config)
