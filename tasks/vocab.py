"""Prefect task for stage ``vocab``: the draft vocabulary and its coverage artifact."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.run_facts import RunFacts


@task(name="draft-vocab", cache_policy=NO_CACHE)
def vocab_task(facts: RunFacts, shards: list[str]) -> dict:
    from eagle3.vocab.stage import run_vocab

    entry = run_vocab(facts, shards, logger=get_run_logger())
    create_markdown_artifact(
        key="draft-vocab",
        markdown=(
            f"**Draft vocabulary**: {entry['draft_vocab_size']} of {entry['target_vocab_size']} target ids "
            f"({'identity' if entry['identity'] else 'top supervised tokens'}); coverage of supervised tokens "
            f"**{100 * entry['coverage']:.2f}%**; written to `{entry['path']}`"
        ),
    )
    return entry
