"""Prefect task for stage ``evaluate``: live acceptance of the exported drafter in vLLM.

Nothing here imports torch; the stage module (httpx + the managed server) loads inside the task.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3.config import PipelineConfig


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def comparison_markdown(doc: dict) -> str:
    """Live mean acceptance length per temperature next to training's offline estimate."""
    offline = (doc.get("offline_estimate") or {}).get("acceptance_length")
    lines = [
        f"**Live acceptance** of `{doc['drafter']}` on `{doc['target']}` "
        f"({doc['num_speculative_tokens']} speculative tokens, {doc['max_tokens']} tokens per request)",
        "",
        "| temperature | mean acceptance length (live) | acceptance rate | offline estimate (training) |",
        "|---|---|---|---|",
    ]
    for row in doc["temperatures"]:
        lines.append(f"| {row['temperature']:g} | {_fmt(row['mean_acceptance_length'])} | {_fmt(row['acceptance_rate'])} | {_fmt(offline)} |")
    untrained = doc.get("untrained")
    if untrained:
        row = untrained["temperatures"][0]
        lines += ["", f"Untrained drafter (same vocabulary and layers) at temperature {row['temperature']:g}: mean acceptance length "
                      f"{_fmt(row['mean_acceptance_length'])}, acceptance rate {_fmt(row['acceptance_rate'])}."]
    if offline is None:
        lines += ["", "No offline estimate: RUN/train/eval.jsonl is missing or has no acceptance_length."]
    note = (doc.get("selection") or {}).get("note")
    if note:
        lines += ["", f"Note: {note}."]
    return "\n".join(lines)


@task(name="evaluate-live", cache_policy=NO_CACHE)
def evaluate_task(config: PipelineConfig) -> dict:
    from eagle3.evaluate.live import run_evaluate

    entry = run_evaluate(config, logger=get_run_logger())
    doc = entry["live"]
    rows = [{
        "temperature": r["temperature"], "requests ok": r["requests_ok"], "requests failed": r["requests_failed"],
        "drafts": r["drafts"], "draft tokens": r["draft_tokens"], "accepted tokens": r["accepted_tokens"],
        "acceptance rate": r["acceptance_rate"], "mean acceptance length": r["mean_acceptance_length"],
        "per position": ", ".join(_fmt(x) for x in r["per_position_acceptance"]), "tokens/s": r["tokens_per_s"],
    } for r in doc["temperatures"]]
    create_table_artifact(key="evaluate-live", table=rows, description="vLLM spec-decode counters per temperature (held-out prompts)")
    create_markdown_artifact(key="evaluate-live-vs-offline", markdown=comparison_markdown(doc))
    return {k: v for k, v in entry.items() if k != "live"}
