"""Exact and near-duplicate detection over a growing set of kept texts.

Design choices:
- Exact duplicates are found after normalising case and whitespace ("Write a poem" and
  "write  a POEM" are one request).
- Near duplicates: Jaccard similarity of the character 5-gram sets of the normalised texts,
  against every text kept so far. Comparing with all of them is quadratic, so candidates come
  from MinHash locality-sensitive hashing (128 hash functions in bands) and each candidate is
  then checked with the exact Jaccard similarity: no false positives, and the band width is
  chosen from the threshold so a pair at the threshold is missed with probability below 0.1%.
- Shingles are hashed with CRC-32 (kept as 4-byte values) and the MinHash permutations come from a fixed seed, never
  Python's salted ``hash``: the same texts give the same decisions in every process.
"""

from __future__ import annotations

import re
import zlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

SHINGLE = 5
NUM_PERM = 128
MAX_MISS = 1e-3
_PRIME = (1 << 61) - 1
_rng = np.random.default_rng(20240601)
_A = _rng.integers(1, 1 << 31, NUM_PERM, dtype=np.uint64)
_B = _rng.integers(0, 1 << 31, NUM_PERM, dtype=np.uint64)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def shingles(norm: str) -> np.ndarray:
    """The set of character 5-grams, as sorted unique CRC-32 values (4 bytes each: a 50k kept set stays ~40 MB)."""
    grams = [norm] if len(norm) <= SHINGLE else [norm[i : i + SHINGLE] for i in range(len(norm) - SHINGLE + 1)]
    return np.unique(np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint32, count=len(grams)))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    both = len(np.intersect1d(a, b, assume_unique=True))
    return both / (len(a) + len(b) - both)


def _signature(grams: np.ndarray) -> np.ndarray:
    x = grams.astype(np.uint64)
    # (a * x + b) mod p with 31-bit a, b and 32-bit x stays below 2^64: no overflow.
    return ((_A[:, None] * x[None, :] + _B[:, None]) % _PRIME).min(axis=1)


def band_rows(threshold: float) -> int:
    """Rows per LSH band: the widest band that still finds a pair at ``threshold`` with probability > 1 - MAX_MISS."""
    for rows in range(8, 0, -1):
        bands = NUM_PERM // rows
        if (1.0 - threshold**rows) ** bands <= MAX_MISS:
            return rows
    return 1


@dataclass(frozen=True)
class Match:
    kind: str  # "duplicate" | "near_duplicate"
    other: int  # the key of the kept text it matches
    similarity: float


class NearDuplicates:
    """The kept set: ``check`` says whether a text matches a kept one, ``add`` keeps it."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.rows = band_rows(threshold)
        self.bands = NUM_PERM // self.rows
        self._exact: dict[str, int] = {}
        self._grams: dict[int, np.ndarray] = {}
        self._buckets: list[dict[bytes, list[int]]] = [defaultdict(list) for _ in range(self.bands)]

    def _band_keys(self, sig: np.ndarray) -> list[bytes]:
        return [sig[b * self.rows : (b + 1) * self.rows].tobytes() for b in range(self.bands)]

    def check(self, text: str) -> tuple[Match | None, tuple]:
        """(the kept text it duplicates, or None; a token to pass to ``add``)."""
        norm = normalise(text)
        if norm in self._exact:
            return Match("duplicate", self._exact[norm], 1.0), ()
        grams = shingles(norm)
        keys = self._band_keys(_signature(grams))
        seen: set[int] = set()
        best: Match | None = None
        for band, key in enumerate(keys):
            for other in self._buckets[band].get(key, ()):
                if other in seen:
                    continue
                seen.add(other)
                sim = jaccard(grams, self._grams[other])
                if sim >= self.threshold and (best is None or sim > best.similarity):
                    best = Match("near_duplicate", other, sim)
        return best, (norm, grams, keys)

    def add(self, key: int, token: tuple) -> None:
        norm, grams, keys = token
        self._exact[norm] = key
        self._grams[key] = grams
        for band, band_key in enumerate(keys):
            self._buckets[band][band_key].append(key)
