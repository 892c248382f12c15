"""Prefect tasks for stage ``train``: torchrun as a subprocess, its output streamed into the task log,
and the artifacts (loss and acceptance curves as a PNG, the evaluation table).

Nothing here imports torch: the stage runs training in torchrun's processes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig
from eagle3.layout import RunLayout
from eagle3.progress import report
from eagle3.run_facts import RunFacts
from tasks import progress_artifacts
from tasks.retry import unless_permanent


@task(
    name="train-drafter", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10, retry_condition_fn=unless_permanent
)
def train_task(facts: RunFacts, shards: list[str]) -> dict:
    """A retry resumes from the last checkpoint (the worker reads checkpoints/latest.json)."""
    from eagle3.train.stage import STEP_LINE, run_train

    logger = get_run_logger()
    artifact = progress_artifacts.start("train: optimizer steps", logger)

    def progress(line: str) -> None:
        match = STEP_LINE.search(line)
        if match:
            progress_artifacts.update(artifact, 100.0 * int(match.group(1)) / int(match.group(2)), logger)
            report("train", "all", int(match.group(1)), int(match.group(2)), unit="steps")

    entry = run_train(facts, shards, logger=logger, on_line=progress)
    progress_artifacts.update(artifact, 100.0, logger)
    return entry


@task(name="train-report", cache_policy=NO_CACHE)
def train_report_task(config: PipelineConfig, entry: dict) -> dict:
    from eagle3.train.plots import plot_curves

    layout = RunLayout.of(config)
    evals = (
        [json.loads(x) for x in layout.train_eval.read_text().splitlines() if x.strip()]
        if layout.train_eval.exists()
        else []
    )
    png = plot_curves(layout.train_log, layout.train_eval, layout.train_curves)
    rows = [
        {
            "step": e["step"],
            "epoch": e["epoch"],
            "acceptance length": round(e["acceptance_length"], 4),
            **{f"acc@{k}": round(a, 4) for k, a in enumerate(e["accuracy"])},
        }
        for e in evals
    ]
    if rows:
        create_table_artifact(
            key="train-eval",
            table=rows,
            description="Held-out evaluation: per-step accuracy and expected acceptance length of a K-token chain",
        )
    best = entry.get("best") or {}
    picture = (
        f"\n\n![training curves](data:image/png;base64,{base64.b64encode(Path(png).read_bytes()).decode()})"
        if png
        else ""
    )
    create_markdown_artifact(
        key="train-summary",
        markdown=(
            f"**Drafter training**: {entry['ok']} optimizer steps, {entry['tokens']} tokens in "
            f"{entry['seconds']} s on {entry['world_size']} process(es). Best checkpoint by held-out acceptance "
            f"length: step {best.get('step')} ({best.get('acceptance_length', 0):.3f}). Curves: `{png}`{picture}"
        ),
    )
    return entry
