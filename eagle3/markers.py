"""One completion protocol for every stage and every shard.

A marker says "this output is complete, for these inputs": a stage or a shard is done when its
marker exists and its ``key`` matches what the stage would compute now. Every marker has the same
name rule (``STEM.done.json`` per shard, ``done.json`` for a whole stage, see ``eagle3/layout.py``)
and the same content:

    {"marker": 1, "stage": "tokenize", "unit": "shard-00000", "key": "...",
     "counts": {"in": 12, "ok": 11, "failed": 0, "filtered": 1, ...},
     "written_at": "2025-01-01T00:00:00Z", ...the stage's own fields}

Design choices:
- Written only through ``write_marker`` (atomic, via eagle3/durable.py), always after the outputs
  it vouches for, and removed (``remove_marker``) before a stage rewrites them: a killed run never
  leaves a marker over partial output.
- Read only through ``read_marker``, which returns None when there is none and raises
  ``MarkerError`` naming the file when it is unreadable or belongs to another stage.
- The stage's own fields stay at the top level, where markers of earlier releases kept them, so
  markers without the ``marker`` field (earlier releases) are read as they are and stay valid: an
  old run directory resumes without redoing work. Earlier whole-stage markers were named
  ``_SUCCESS.json``; ``read_marker`` reads that name when ``done.json`` is absent, and the stage's
  next write replaces it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.durable import atomic_write_json, read_json, remove_inside, writing
from eagle3.errors import InputError
from eagle3.layout import LEGACY_STAGE_MARKER, MARKER_SUFFIX, STAGE_MARKER

FORMAT = 1
HEADER = ("marker", "stage", "unit", "key", "counts", "written_at")
COUNTS = ("in", "ok", "failed", "filtered")


class MarkerError(InputError, ValueError):
    """A completion marker that cannot be trusted: unreadable, or written by another stage."""


@dataclass(frozen=True)
class Marker:
    """A completion marker as read from disk. ``fields`` is the whole JSON object."""

    path: Path
    stage: str
    unit: str | None
    key: str | None
    counts: dict
    written_at: str | None
    fields: dict = field(repr=False)
    legacy: bool = False

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def is_marker_name(name: str) -> bool:
    return name == STAGE_MARKER or name.endswith(MARKER_SUFFIX) or name == LEGACY_STAGE_MARKER


def _unit(path: Path) -> str | None:
    return path.name.removesuffix(MARKER_SUFFIX) if path.name.endswith(MARKER_SUFFIX) else None


def _counts(counts: dict, where: Path) -> dict:
    missing = [k for k in ("in", "ok") if k not in counts]
    if missing:
        raise MarkerError(f"{where}: marker counts lack {missing}")
    out = {**counts, "failed": counts.get("failed", 0), "filtered": counts.get("filtered", 0)}
    if out["in"] != out["ok"] + out["failed"] + out["filtered"]:
        raise MarkerError(
            f"{where}: marker counts in={out['in']} but ok + failed + filtered = "
            f"{out['ok'] + out['failed'] + out['filtered']}: rows were lost"
        )
    return out


def write_marker(path: str | Path, stage: str, key: str | None, counts: dict, /, **fields: Any) -> Marker:
    """Write the completion marker at ``path`` (whole, atomically) and return it as read back.

    ``counts`` needs ``in`` and ``ok`` (``failed``/``filtered`` default to 0; extra counts such as
    ``retryable`` are kept); ``fields`` are the stage's own results and must not reuse a header name."""
    path = Path(path)
    clash = sorted(set(fields) & set(HEADER))
    if clash:
        raise ValueError(f"{path}: marker fields {clash} are reserved for the header")
    doc = {
        **fields,
        "marker": FORMAT,
        "stage": stage,
        "unit": _unit(path),
        "key": key,
        "counts": _counts(counts, path),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with writing(path, stage):
        atomic_write_json(path, doc)
    if path.name == STAGE_MARKER:  # the earlier name must not outlive the new marker and be read instead
        remove_inside(path.with_name(LEGACY_STAGE_MARKER), path.parent)
    return _parse(path, doc, stage)


def _parse(path: Path, doc: Any, stage: str) -> Marker:
    if not isinstance(doc, dict):
        raise MarkerError(f"{path}: a completion marker must be a JSON object, not {type(doc).__name__}")
    version = doc.get("marker")
    if version is None:  # an earlier release's marker: its fields are where they always were
        key = doc.get("key", doc.get("fingerprint"))
        counts = doc.get("counts") if isinstance(doc.get("counts"), dict) else {}
        return Marker(path, stage, _unit(path), key, counts, None, doc, legacy=True)
    if version != FORMAT:
        raise MarkerError(
            f"{path}: marker format {version!r} is not one this version reads ({FORMAT}); it was written by "
            f"another eagle3 version: delete it to redo {stage} for it"
        )
    if doc.get("stage") != stage:
        raise MarkerError(
            f"{path}: this is a marker of stage {doc.get('stage')!r}, but {stage} reads it: a file was copied "
            "or moved into the wrong folder; delete it to redo that work"
        )
    return Marker(path, stage, doc.get("unit"), doc.get("key"), doc["counts"], doc.get("written_at"), doc)


def read_marker(path: str | Path, stage: str) -> Marker | None:
    """The marker at ``path`` for ``stage``, or None when there is none (a whole-stage marker of an
    earlier release, ``_SUCCESS.json``, counts as the same marker)."""
    path = Path(path)
    found = path
    if not found.exists() and path.name == STAGE_MARKER:
        found = path.with_name(LEGACY_STAGE_MARKER)
    if not found.exists():
        return None
    try:
        doc = read_json(found)
    except ValueError as exc:
        raise MarkerError(f"{exc}; delete it to redo {stage} for it") from None
    return _parse(found, doc, stage)


def remove_marker(path: str | Path, root: str | Path) -> None:
    """Remove a marker (and a whole-stage marker's earlier name) before its outputs are rewritten."""
    path = Path(path)
    remove_inside(path, root)
    if path.name == STAGE_MARKER:
        remove_inside(path.with_name(LEGACY_STAGE_MARKER), root)
