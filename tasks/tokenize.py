"""Prefect tasks for stages ``tokenize`` (one per shard) and ``vocab``."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.cluster import enter_workdir
from eagle3.config import PipelineConfig
from tasks.retry import unless_permanent


# Disk markers (keyed on input hashes, tokenizer and settings) decide what is done.
@task(name="tokenize-shard", cache_policy=NO_CACHE, retries=1, retry_condition_fn=unless_permanent)
def tokenize_shard_task(config: PipelineConfig, shard: str):
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path

    enter_workdir()
    path = tokenizer_path(config)
    return tokenize_shard(config, shard, load_tokenizer(path), path, logger=get_run_logger())


@task(name="tokenize-summary", cache_policy=NO_CACHE)
def tokenize_summary_task(config: PipelineConfig, results: list) -> dict:
    from eagle3.tokenize.stage import record
    from eagle3.tokenizer import tokenizer_path

    entry = record(config, results, tokenizer_path(config))
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


def shard_names(config: PipelineConfig) -> list[str]:
    from eagle3.run_facts import prepared_shards

    return [Path(s).name for s in prepared_shards(config)]
