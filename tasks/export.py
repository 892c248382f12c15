"""Prefect task for stage ``export``: the chosen checkpoint in every configured layout.

Nothing here imports torch: the stage module is imported inside the task.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.run_facts import RunFacts


# export_info.json in each layout folder (checkpoint bytes + settings) decides what is done.
@task(name="export", cache_policy=NO_CACHE)
def export_task(facts: RunFacts) -> dict:
    from eagle3.export.stage import run_export

    entry = run_export(facts, logger=get_run_logger())
    rows = [
        {"layout": layout, "status": "reused" if layout in entry["reused"] else "written", "path": path}
        for layout, path in entry["paths"].items()
    ]
    rows += [
        {"layout": layout, "status": "skipped: " + "; ".join(reasons), "path": ""}
        for layout, reasons in entry["skipped"].items()
    ]
    create_table_artifact(
        key="export-layouts",
        table=rows,
        description=f"export of {entry['checkpoint']} (step {entry['step']}, chosen by {entry['chosen_by']})",
    )
    return entry
