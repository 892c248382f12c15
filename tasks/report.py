"""The run report at the end of the pipeline: RUN/report.md and the same page as a Prefect artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig


@task(name="run-report", cache_policy=NO_CACHE)
def report_task(config: PipelineConfig) -> str:
    from eagle3.report import markdown_report, write_report

    path = write_report(config.run_dir)
    create_markdown_artifact(
        key="pipeline-report",
        markdown=markdown_report(config.run_dir, embed_png=True),
        description=f"eagle3 run report ({path})",
    )
    return str(path)
