"""Human-readable accounting read back from a run directory (``eagle3 status``)."""

from __future__ import annotations

from pathlib import Path

from eagle3.manifest import MANIFEST, read_manifest

COLUMNS = ("stage", "status", "in", "ok", "failed", "filtered", "reasons")
ORDER = ("prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate")


def _reasons(entry: dict) -> str:
    reasons = entry.get("reasons") or {}
    return ", ".join(f"{k}={n}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])) or "-"


def status_rows(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: not a run directory, or no stage has finished yet")
    stages = read_manifest(run_dir).get("stages", {})
    return [
        {"stage": name, "status": e.get("status", "ok"), "in": e["in"], "ok": e["ok"], "failed": e["failed"], "filtered": e["filtered"], "reasons": _reasons(e)}
        for name, e in sorted(stages.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER))
    ]


def status_table(run_dir: str | Path) -> str:
    rows = [{c: str(r[c]) for c in COLUMNS} for r in status_rows(run_dir)]
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in COLUMNS}
    fmt = lambda r: "  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip()  # noqa: E731
    lines = [f"run: {run_dir}", fmt({c: c for c in COLUMNS}), fmt({c: "-" * widths[c] for c in COLUMNS})]
    return "\n".join(lines + [fmt(r) for r in rows])
