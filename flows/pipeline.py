"""Flow ``eagle3-pipeline``: every stage that exists, in order, as subflows.

Later stages plug in here as they are built; each also runs alone through its own flow.
"""

from __future__ import annotations

import datetime

from prefect import flow
from prefect.runtime import flow_run

from eagle3.config import PipelineConfig
from flows.evaluate import evaluate_flow
from flows.export import export_flow
from flows.extract import extract_flow
from flows.generate import generate_flow
from flows.prepare import prepare_flow
from flows.tokenize import tokenize_flow
from flows.train import train_flow
from flows.vocab import vocab_flow
from tasks.report import report_task

# Stages in pipeline order; the ones not listed in BUILT are not available yet.
STAGES = ("prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate")
BUILT = STAGES
FLOWS = {
    "prepare": prepare_flow,
    "generate": generate_flow,
    "tokenize": tokenize_flow,
    "vocab": vocab_flow,
    "extract": extract_flow,
    "train": train_flow,
    "export": export_flow,
    "evaluate": evaluate_flow,
}


def run_name() -> str:
    """'<model>-<UTC date and time>', so the runs list says what each run is."""
    config = flow_run.parameters.get("config")
    model = (
        config.server.model
        if isinstance(config, PipelineConfig)
        else (config or {}).get("server", {}).get("model", "tiny:qwen3")
    )
    short = model.rstrip("/").split("/")[-1].replace(":", "-")
    return f"{short}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M}"


@flow(
    name="eagle3-pipeline",
    flow_run_name=run_name,
    description="Prompts to a trained, exported and live-evaluated EAGLE-3 drafter.",
)
async def pipeline_flow(config: PipelineConfig = PipelineConfig()) -> dict:
    results = {"prepare": prepare_flow(config)}
    results["generate"] = await generate_flow(config)
    results["tokenize"] = tokenize_flow(config)
    results["vocab"] = vocab_flow(config)
    results["extract"] = extract_flow(config)
    results["train"] = train_flow(config)
    results["export"] = export_flow(config)
    results["evaluate"] = evaluate_flow(config)
    results["report"] = report_task(config)
    return results
