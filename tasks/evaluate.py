"""Prefect task for stage ``evaluate``: the exported drafter against the alternatives, live in vLLM.

Nothing here imports torch; the stage module (httpx + the managed server) loads inside the task.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.run_facts import RunFacts


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def comparison_markdown(doc: dict) -> str:
    """The live comparison table, then the trained drafter's live acceptance next to training's offline estimate."""
    from eagle3.evaluate.table import markdown_table

    offline = (doc.get("offline_estimate") or {}).get("acceptance_length")
    head = doc.get("headline") or {}
    lines = [
        f"**Live comparison** on `{doc['target']}`" + (f", drafter `{doc['drafter']}`" if doc.get("drafter") else ""),
        "",
        markdown_table(doc),
        "",
    ]
    if head.get("acceptance_length_trained") is not None:
        lines.append(
            f"Trained drafter, {head['prompt_set']} prompts, T={head['temperature']:g}, concurrency "
            f"{head['concurrency']}: live mean acceptance length {_fmt(head['acceptance_length_trained'])}, "
            f"offline estimate (training) {_fmt(offline)}."
        )
    if offline is None:
        lines += ["", "No offline estimate: RUN/train/eval.jsonl is missing or has no acceptance_length."]
    return "\n".join(lines)


@task(name="evaluate-live", cache_policy=NO_CACHE)
def evaluate_task(facts: RunFacts):
    from eagle3.evaluate.live import run_evaluate
    from eagle3.evaluate.table import cell_row
    from eagle3.results import EvaluateStageResult

    entry = run_evaluate(facts, logger=get_run_logger())
    doc = entry["live"]
    create_table_artifact(
        key="evaluate-live",
        table=[cell_row(c) for c in doc["cells"]],
        description="Decode tokens/s and acceptance per method, prompt set, temperature and concurrency (vLLM, live)",
    )
    create_markdown_artifact(key="evaluate-live-vs-offline", markdown=comparison_markdown(doc))
    # The typed result, not the live document: only references cross the task boundary.
    return EvaluateStageResult.from_entry({k: v for k, v in entry.items() if k != "live"})
