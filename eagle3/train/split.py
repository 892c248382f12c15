"""The held-out split: by a hash of the sample's *prompt* id, so it is stable across reruns, shard
counts and stages (training evaluates on it; live evaluation sends its prompts), and every sample of
one prompt (generation.samples_per_prompt) lands on the same side: a held-out prompt is never also
trained on through its other samples."""

from __future__ import annotations

import hashlib

from eagle3.generate.samples import prompt_of


def is_heldout(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"eagle3-heldout:{prompt_of(sample_id)}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction
