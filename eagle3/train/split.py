"""The held-out split: by a hash of the sample id, so it is stable across reruns, shard counts
and stages (training evaluates on it; live evaluation sends its prompts)."""

from __future__ import annotations

import hashlib


def is_heldout(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"eagle3-heldout:{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction
