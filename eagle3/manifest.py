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
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3.durable import atomic_write_json, read_json
from eagle3.errors import PermanentError
from eagle3.layout import RunLayout


class AccountingError(PermanentError, RuntimeError):
    """A stage's counts do not add up: rows were lost."""


@dataclass(frozen=True)
class StageCounts:
    """Rows into a stage and where each one went."""

    in_: int
    ok: int
    failed: int = 0
    filtered: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def check(self, stage: str) -> None:
        if self.in_ != self.ok + self.failed + self.filtered:
            raise AccountingError(
                f"stage {stage}: in={self.in_} but ok={self.ok} + failed={self.failed} + "
                f"filtered={self.filtered} = {self.ok + self.failed + self.filtered}: rows were lost"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "in": self.in_,
            "ok": self.ok,
            "failed": self.failed,
            "filtered": self.filtered,
            "reasons": dict(sorted(self.reasons.items())),
        }


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
    from eagle3.results import build

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
