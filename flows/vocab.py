"""Flow ``eagle3-vocab``: the draft vocabulary (d2t, t2d) from supervised-token counts."""

from __future__ import annotations

from prefect import flow

from eagle3.config import PipelineConfig
from eagle3.run_facts import RunFacts
from tasks.vocab import vocab_task


@flow(name="eagle3-vocab", description="The draft vocabulary (d2t, t2d) from supervised-token counts.")
def vocab_flow(config: PipelineConfig = PipelineConfig(), facts: RunFacts | None = None) -> dict:
    facts = RunFacts.of(config, facts)
    return vocab_task(facts, facts.shard_names("vocab"))
