"""Stage ``generate`` as a whole: which shards to run, and the accounting over all of them.

Per-shard work lives in ``shard.py``; this module reads the disk (the truth) to add up
the stage, records it in the manifest, and fails the stage loudly when too much failed.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from eagle3.config import GenerationConfig, PipelineConfig, section_hash
from eagle3.errors import TransientError
from eagle3.generate.shard import STAGE, paths
from eagle3.layout import RunLayout
from eagle3.manifest import record_stage, versions
from eagle3.markers import read_marker
from eagle3.results import StageCounts
from eagle3.serving.client import deadline_s


class GenerationFailed(TransientError, RuntimeError):
    """More samples failed than generation.max_failure_fraction allows."""


def out_dir(config: PipelineConfig) -> Path:
    return RunLayout.of(config).generations


def shard_timeout_s(num_prompts: int, concurrency: int, gen: GenerationConfig) -> float:
    """A Prefect task timeout that only a stuck shard reaches: every wave of requests
    taking its full deadline on every attempt, plus the longest backoffs."""
    waves = max(1, math.ceil(num_prompts / max(1, concurrency)))
    return waves * gen.max_attempts * (deadline_s(gen) + gen.backoff_max_s) + 300


def summarize(config: PipelineConfig, shards: list[Path]) -> dict:
    """Add up every shard's marker; a shard without one counts its unfinished samples as failed.

    Beside the counts: samples per sampling variant (temperature, top_p, reasoning settings) and,
    in regenerate mode, conversations kept shorter by reason."""
    totals = {"in": 0, "ok": 0, "failed": 0, "filtered": 0, "retryable": 0}
    errors: dict[str, int] = {}
    variants: Counter = Counter()
    shortened: Counter = Counter()
    incomplete = []
    for shard in shards:
        done = read_marker(paths(out_dir(config), shard.name)["done"], STAGE)
        if done is not None:
            counts, kinds = done.counts, done["errors"]
            variants.update(done.get("variants") or {})
            shortened.update((done.get("turns") or {}).get("shortened_by_reason") or {})
        else:
            counts, kinds = _unfinished(config, shard), {"shard_incomplete": None}
            incomplete.append(shard.name)
        for k in totals:
            totals[k] += counts[k]
        for kind, n in kinds.items():
            errors[kind] = errors.get(kind, 0) + (n if n is not None else counts["failed"])
    out = {**totals, "errors": errors, "incomplete_shards": incomplete, "variants": _readable(variants)}
    if config.data.turns == "regenerate":
        out["shortened"] = dict(shortened)
    return out


def _readable(variants: Counter) -> dict[str, int]:
    """Variant labels as 'temperature=0.6 top_p=0.95 ...' for the manifest and the report."""
    out: dict[str, int] = {}
    for label, n in sorted(variants.items()):
        fields = json.loads(label)
        text = " ".join(f"{k}={json.dumps(v, sort_keys=True) if isinstance(v, dict) else v}" for k, v in fields.items())
        out[text] = out.get(text, 0) + n
    return out


def _unfinished(config: PipelineConfig, shard: Path) -> dict:
    import pyarrow.parquet as pq

    from eagle3.generate.samples import expected_ids
    from eagle3.records import read_ids

    p = paths(out_dir(config), shard.name)
    prompt_ids = pq.read_table(shard, columns=["id"]).column("id").to_pylist()
    ids = set(expected_ids(prompt_ids, config.generation.samples_per_prompt))
    ok = read_ids(p["ok"]) & ids
    filtered = (read_ids(p["filtered"]) & ids) - ok
    failed = len(ids) - len(ok) - len(filtered)
    return {"in": len(ids), "ok": len(ok), "filtered": len(filtered), "failed": failed, "retryable": failed}


def record(config: PipelineConfig, summary: dict, model: str, server: dict | None = None) -> dict:
    """Write the stage's manifest entry; raise GenerationFailed past the threshold.

    server: what happened to the server during the stage (e.g. server_restarts), recorded as is.
    """
    gen = config.generation
    fraction = summary["failed"] / summary["in"] if summary["in"] else 0.0
    error = None
    if fraction > gen.max_failure_fraction or summary["incomplete_shards"]:
        error = (
            f"generate: {summary['failed']} of {summary['in']} samples failed ({fraction:.2%}; "
            f"generation.max_failure_fraction={gen.max_failure_fraction}); errors by kind: {summary['errors']}; "
            f"incomplete shards: {summary['incomplete_shards'] or 'none'}. Rerunning resumes: finished samples "
            "are kept."
        )
    reasons = {"truncated": summary["filtered"]} if summary["filtered"] else {}
    counts = StageCounts(
        summary["in"], summary["ok"], summary["failed"], summary["filtered"], {**reasons, **summary["errors"]}
    )
    entry = record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="failed" if error else "ok",
        error=error,
        model=model,
        config_hash=section_hash(gen),
        deadline_s=deadline_s(gen),
        versions=versions("openai", "httpx"),
        samples_per_prompt=gen.samples_per_prompt,
        turns=config.data.turns,
        reasoning=gen.reasoning,
        variants=summary.get("variants", {}),
        **({"shortened": summary["shortened"]} if "shortened" in summary else {}),
        **(server or {}),
    )
    if error:
        raise GenerationFailed(error)
    return entry


def summary_line(entry: dict, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    return f"generations:  {Path(run_dir) / 'generations'}  (failures: shard-*.failed.jsonl; server log: server.log)"
