"""Stage ``export``: the chosen checkpoint, written in every configured layout and checked.

- The checkpoint is ``RUN/checkpoints/best.json``'s (the best held-out acceptance), else the
  highest ``step-N`` folder; a best.json naming a folder that is gone is an error, not a silent
  fallback to another checkpoint.
- A layout that cannot hold this drafter (SGLang's Llama-only EAGLE-3 layer for a Qwen3-style
  drafter, see layouts/sglang.py) is skipped with its reason and counted as ``filtered``; any other
  problem fails the stage.
- Disk decides what is done: the stage's completion marker ``RUN/export/done.json`` (the one
  protocol, eagle3/markers.py) is keyed on the checkpoint's bytes and the export settings and lists
  the layouts written; a listed layout that still validates is kept as it is. The marker is removed
  before any layout is rewritten and written after every layout validates. Each layout folder also
  holds ``export_info.json``: provenance for whoever loads it (which checkpoint, which settings).
  Run directories of earlier releases have no marker: their layouts are exported again, in seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import read_json
from eagle3.errors import MissingInputError, run_first
from eagle3.export.layouts import (
    CKPT_CONFIG,
    EXPORT_VERSION,
    WEIGHTS,
    ExportError,
    export_checkpoint,
    source_fingerprint,
    unsupported_reasons,
    validate_export,
)
from eagle3.layout import RunLayout
from eagle3.manifest import record_stage, versions
from eagle3.markers import read_marker, remove_marker, write_marker
from eagle3.results import StageCounts
from eagle3.run_facts import RunFacts

STAGE = "export"
_STEP = re.compile(r"step-(\d+)")


class MissingCheckpoint(MissingInputError, ExportError):
    """No drafter checkpoint to export: the train stage has not written one."""


class InvalidExport(ExportError):
    """An exported folder failed validation."""


def out_root(config: PipelineConfig) -> Path:
    return RunLayout.of(config).export


def find_checkpoint(run_dir: str | Path) -> tuple[Path, int | None, str]:
    """(checkpoint folder, step, how it was chosen)."""
    folder = Path(run_dir) / "checkpoints"
    best = folder / "best.json"
    if best.exists():
        entry = read_json(best)
        path = folder / Path(entry["path"]).name  # this run's own folder, even when the run dir was moved
        if not ((path / WEIGHTS).exists() and (path / CKPT_CONFIG).exists()):
            problem = f"names {path}, which lacks {WEIGHTS} or {CKPT_CONFIG}"
            raise MissingCheckpoint(STAGE, best, run_first("eagle3 train"), problem)
        return path, entry.get("step"), "best.json"
    steps = []
    for path in folder.glob("step-*") if folder.is_dir() else []:
        match = _STEP.fullmatch(path.name)
        if match and (path / WEIGHTS).exists() and (path / CKPT_CONFIG).exists():
            steps.append((int(match.group(1)), path))
    if not steps:
        problem = f"holds no drafter checkpoint (no best.json, no step-N folder holding {WEIGHTS} and {CKPT_CONFIG})"
        raise MissingCheckpoint(STAGE, folder, run_first("eagle3 train"), problem)
    step, path = max(steps)
    return path, step, "highest step"


def _key(fingerprint: dict, num_tokens: int, target: str) -> str:
    """What an export depends on: the checkpoint's bytes, the draft length, the target, the writer's version."""
    text = json.dumps([EXPORT_VERSION, fingerprint, num_tokens, str(target)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _done_layouts(layout: RunLayout, key: str) -> set[str]:
    """The layouts the stage marker says were written for this key."""
    marker = read_marker(layout.export_marker, STAGE)
    return set(marker["paths"]) if marker is not None and marker.key == key else set()


def run_export(facts: RunFacts, logger=None) -> dict:
    """Export the run's checkpoint in ``export.formats`` under RUN/export/; the manifest entry plus paths.
    The target (its folder, its depth) is the run's facts'."""
    from eagle3.drafter.model import DrafterConfig

    config = facts.config
    log = logger or logging.getLogger(__name__)
    formats = list(dict.fromkeys(config.export.formats))
    ckpt, step, chosen = find_checkpoint(config.run_dir)
    target = facts.model_dir()
    num_tokens = config.evaluate.num_speculative_tokens
    drafter = DrafterConfig.load(ckpt / CKPT_CONFIG)
    layers = facts.target_shape()[0]
    skipped = {f: r for f in formats if (r := unsupported_reasons(f, drafter, layers))}
    for layout, reasons in skipped.items():
        log.warning("export: skipping the %s layout: %s", layout, "; ".join(reasons))
    wanted = [f for f in formats if f not in skipped]
    root, run = out_root(config), RunLayout.of(config)
    fingerprint = source_fingerprint(ckpt)
    key = _key(fingerprint, num_tokens, target)
    done = _done_layouts(run, key)
    reused = [f for f in wanted if f in done and not validate_export(root / f, f, target)]
    todo = [f for f in wanted if f not in reused]
    if todo:
        remove_marker(run.export_marker, run.root)  # a kill while rewriting must not leave it vouching
        log.info("export: %s (step %s, chosen by %s) -> %s as %s", ckpt, step, chosen, root, todo)
        export_checkpoint(ckpt, target, root, todo, num_speculative_tokens=num_tokens)
    if reused:
        log.info("export: %s already exported from these checkpoint bytes, kept", reused)
    problems = {f: p for f in wanted if (p := validate_export(root / f, f, target))}
    lines = "\n".join(f"  {f}: {p}" for f, ps in problems.items() for p in ps)
    error = (
        f"export of {ckpt} failed validation:\n{lines}"
        if problems
        else None
        if wanted
        else f"export: none of {formats} can hold this drafter: {skipped}"
    )
    paths = {f: str(root / f) for f in wanted if f not in problems}
    reasons = {**{f"unsupported_layout:{f}": 1 for f in skipped}, **{f"invalid:{f}": 1 for f in problems}}
    counts = StageCounts(len(formats), len(paths), len(problems), len(skipped), reasons)
    entry = record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="failed" if error else "ok",
        error=error,
        checkpoint=str(ckpt),
        step=step,
        chosen_by=chosen,
        target=target,
        paths=paths,
        reused=reused,
        skipped=skipped,
        problems=problems,
        config_hash=section_hash(config.export),
        versions=versions("torch", "safetensors"),
    )
    if problems:
        raise InvalidExport(error)
    if error:
        raise ExportError(error)
    write_marker(run.export_marker, STAGE, key, counts.as_dict(), paths=paths, skipped=skipped, step=step)
    return entry


def summary_line(entry: dict, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    layouts = ", ".join(sorted((entry.get("paths") or {}).keys())) or "see the manifest"
    return f"export:       {Path(run_dir) / 'export'}  ({layouts})"
