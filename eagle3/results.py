"""Typed stage results: what a stage did, as one small frozen value.

A stage's run returns one; the same object becomes its manifest entry (``to_entry``), is read
back from the manifest by ``eagle3 status`` and the report (``from_entry``), and is what the
Prefect task publishes as artifacts and returns. Only references cross a task boundary: counts,
paths, hashes and versions, never data.

Each stage subclasses ``StageResult`` in its own package with its typed fields; the registry
(``eagle3/stages.py``) names the class. Keys a manifest holds that the class does not know (an
older or newer version wrote them) are kept in ``extra`` and written back unchanged.

A result also reads as its manifest entry (``result["ok"]``, ``dict(result)``): the shape the
manifest, the Prefect artifacts and code written against the manifest use.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from eagle3.manifest import StageCounts

COUNT_KEYS = ("in", "ok", "failed", "filtered", "reasons")
R = TypeVar("R", bound="StageResult")


@dataclass(frozen=True, kw_only=True)
class StageResult(Mapping):
    """The fields every stage records; a subclass adds its own after them."""

    STAGE: ClassVar[str] = ""

    counts: StageCounts
    status: str = "ok"
    error: str | None = None
    config_hash: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)
    recorded_at: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.to_entry()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_entry())

    def __len__(self) -> int:
        return len(self.to_entry())

    def stamped(self: R) -> R:
        """This result with the time it is recorded."""
        return dataclasses.replace(self, recorded_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def to_entry(self) -> dict[str, Any]:
        """The manifest entry: the counts flat at the top, then every field but the empty optional ones."""
        entry = self.counts.as_dict()
        for f in dataclasses.fields(self):
            if f.name in ("counts", "extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.name == "error":
                continue
            entry[f.name] = _plain(value)
        return {**entry, **self.extra}

    @classmethod
    def from_entry(cls: type[R], entry: Mapping[str, Any]) -> R:
        """Read a manifest entry back; unknown keys go to ``extra``, missing optional ones keep defaults."""
        counts = StageCounts(
            entry["in"], entry["ok"], entry.get("failed", 0), entry.get("filtered", 0), dict(entry.get("reasons") or {})
        )
        known = {f.name for f in dataclasses.fields(cls)} - {"counts", "extra"}
        kwargs = {k: entry[k] for k in known if k in entry}
        extra = {k: v for k, v in entry.items() if k not in known and k not in COUNT_KEYS}
        return cls(counts=counts, extra=extra, **kwargs)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, mappings as dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
