"""Prefect tasks for stage ``tokenize``: one per shard, then the summary. The tokenizer and the
shard list come from the run's facts (eagle3/run_facts.py), resolved where the run started."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.cluster import enter_workdir
from eagle3.run_facts import RunFacts
from tasks.retry import unless_permanent


# Disk markers (keyed on input hashes, tokenizer and settings) decide what is done.
@task(name="tokenize-shard", cache_policy=NO_CACHE, retries=1, retry_condition_fn=unless_permanent)
def tokenize_shard_task(facts: RunFacts, shard: str):
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer

    enter_workdir()
    return tokenize_shard(facts, shard, load_tokenizer(facts.tokenizer()[0]), logger=get_run_logger())


@task(name="tokenize-summary", cache_policy=NO_CACHE)
def tokenize_summary_task(facts: RunFacts, results: list) -> dict:
    from eagle3.tokenize.stage import record

    entry = record(facts, results)
    rows = [
        {
            "shard": r.shard,
            "in": r.in_,
            "ok": r.ok,
            "filtered": r.filtered,
            "tokens": r.tokens,
            "supervised": r.supervised,
            "truncated": r.truncated,
            "template mismatches": f"{r.template_check['full_mismatch']}/{r.template_check['checked']}",
        }
        for r in results
    ]
    create_table_artifact(
        key="tokenize-shards",
        table=rows,
        description=f"tokenize: {entry['ok']} rows, {entry['supervised_tokens']} supervised tokens",
    )
    return entry
