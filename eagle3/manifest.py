"""The run manifest: per-stage accounting, read by ``eagle3 status`` and the report.

Each stage records ``in``, ``ok``, ``failed`` and ``filtered`` plus counts of reasons,
the hash of the config section it ran with and the versions of what produced it. The
invariant ``in == ok + failed + filtered`` is checked when a stage records itself, so
a stage that loses rows cannot write a manifest that hides it.

Writers take an exclusive lock on a side file, read, update their own stage and
rename the new file in, so concurrent stages never lose each other's entries.
"""

from __future__ import annotations

import fcntl
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3.durable import atomic_write_json, read_json
from eagle3.layout import RunLayout
from eagle3.results import StageCounts, build


def versions(*packages: str) -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("eagle3-pipeline", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def record_stage(run_dir: str | Path, stage: str, counts: StageCounts, **fields: Any):
    """Check the counts and write them, as the stage's typed result (``eagle3.results``), as
    ``stage``'s entry of the run manifest; returns that result (it also reads as the entry)."""
    counts.check(stage)
    result = build(stage, counts, fields).stamped()
    layout = RunLayout.of(run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    with open(layout.manifest_lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_manifest(run_dir)
        manifest.setdefault("stages", {})[stage] = result.to_entry()
        atomic_write_json(layout.manifest, manifest)
    return result


def read_manifest(run_dir: str | Path) -> dict:
    path = RunLayout.of(run_dir).manifest
    return read_json(path) if path.exists() else {"stages": {}}
