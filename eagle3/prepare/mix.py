"""The sources of one prepare run: a plain source, a preset, or a weighted mix of them.

Design choices:
- One shape for every run: a list of ``Part``s (name, where the rows are, the preset that maps them,
  how many rows to take). A plain ``data.source`` is one part with ``data.limit`` as its quota, read
  exactly as before presets existed (same sample, same order, same bytes).
- Weights split the run's row budget, not its kept prompts: part i is asked for
  ``budget * w_i / sum(w)`` rows, rounded by largest remainders (ties to the earlier entry) so the
  quotas add up to the budget exactly. Exact fractions, no floats, so the split never depends on
  rounding. The budget is ``data.limit``; without it, the largest total every part can supply in these
  proportions (the scarcest source, relative to its weight, is read whole).
- Each part samples its quota with its own seed, derived from ``data.seed`` and the part's name, so
  reordering ``data.mix`` or adding an entry does not change which rows another entry gets.
- A part with fewer rows than its quota gives them all and the shortfall is recorded; the other parts
  keep their quotas rather than growing to fill the gap (the mix asked for that much of them).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from fractions import Fraction

from eagle3.config import DataConfig
from eagle3.config.data import DEFAULT_SPLIT, MixSource
from eagle3.prepare import presets
from eagle3.prepare.presets import Preset
from eagle3.prepare.sources import Source, SourceError


@dataclass
class Part:
    name: str
    source: Source
    preset: Preset | None
    weight: Fraction | None  # None: the single source of an unmixed run
    seed: int
    quota: int | None = None  # rows asked for; None: every row

    def describe(self) -> dict:
        """The part's settings as the manifest records them beside its counts."""
        out = {"name": self.name, "source": self.source.spec, "split": self.source.split}
        if self.source.subset is not None:
            out["subset"] = self.source.subset
        if self.preset is not None:
            out["preset"] = self.preset.name
        if self.weight is not None:
            out["weight"] = float(self.weight)
        if self.quota is not None:
            out["quota"] = self.quota
        return out


def _where(preset: Preset | None, source: str | None, split: str | None, subset: str | None):
    """(spec, split, subset) to read: a preset's split and subset go with its own hub id; elsewhere
    (a local copy, another hub id) the ones given apply."""
    if preset is not None and (source is None or source == preset.hub_id):
        return preset.hub_id, split or preset.split, subset if subset is not None else preset.subset
    return str(source), split or DEFAULT_SPLIT, subset


def part_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def _single(data: DataConfig, spec: str | None) -> Part:
    preset = presets.get(data.preset) if data.preset is not None else None
    if spec is None:  # the configured source; a preset replaces data.source (preset_source None: its hub id)
        spec = data.preset_source if preset is not None else data.source
    split = None if preset is not None and data.split == DEFAULT_SPLIT else data.split
    where, split, subset = _where(preset, spec, split, data.subset)
    name = preset.name if preset is not None else where
    source = Source(where, split, subset, data.streaming)
    return Part(name, source, preset, None, data.seed, data.limit)


def _mixed(data: DataConfig, entry: MixSource) -> Part:
    preset = presets.get(entry.preset) if entry.preset is not None else None
    where, split, subset = _where(preset, entry.source, entry.split, entry.subset)
    streaming = data.streaming if entry.streaming is None else entry.streaming
    source = Source(where, split, subset, streaming)
    return Part(entry.label, source, preset, Fraction(entry.weight), part_seed(data.seed, entry.label))


def quotas(weights: list[Fraction], budget: int) -> list[int]:
    """``budget`` split in proportion to ``weights`` by largest remainders (ties to the earlier one)."""
    total = sum(weights)
    exact = [budget * w / total for w in weights]
    out = [int(x) for x in exact]  # floor: every value is a non-negative Fraction
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: budget - sum(out)]:
        out[i] += 1
    return out


def _budget(parts: list[Part], limit: int | None) -> int:
    if limit is not None:
        return limit
    unsized = [p.name for p in parts if not p.source.sized]
    if unsized:
        raise SourceError(
            f"data.mix without data.limit reads the largest mix the sources hold in proportion, which needs "
            f"each source's row count; streamed hub sources {unsized} have none: set data.limit"
        )
    total = sum(p.weight for p in parts)
    # part i can supply count_i rows, i.e. a total of count_i * total / w_i; the scarcest one decides.
    return min(int(p.source.count() * total / p.weight) for p in parts)


def plan(data: DataConfig, spec: str | None = None) -> list[Part]:
    """The parts of this run, with their quotas. ``spec`` replaces data.source (self:prompts' file)."""
    if not data.mix:
        return [_single(data, spec)]
    parts = [_mixed(data, entry) for entry in data.mix]
    for part, quota in zip(parts, quotas([p.weight for p in parts], _budget(parts, data.limit))):
        part.quota = quota
    return parts
