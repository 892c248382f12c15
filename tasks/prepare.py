"""Prefect task for stage ``prepare``: unpack config, call the library, report, return a reference."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.prepare.stage import PrepareResult, run_prepare


# The completion marker on disk decides whether work is needed (it checks the
# input fingerprint and every shard's hash), so Prefect's cache is not used here.
@task(name="prepare-prompts", cache_policy=NO_CACHE)
def prepare_task(config: PipelineConfig) -> PrepareResult:
    result = run_prepare(config, logger=get_run_logger())
    counts = result.counts
    rows = [{"measure": k, "value": counts[k]} for k in ("in", "ok", "failed", "filtered")]
    rows += [{"measure": f"filtered: {kind}", "value": n} for kind, n in counts["reasons"].items()]
    create_table_artifact(
        key="prepare-accounting",
        table=rows,
        description=f"prepare: {result.out_dir} ({'up to date, skipped' if result.skipped else 'built'})",
    )
    return result
