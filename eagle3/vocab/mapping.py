"""Stage ``vocab``: the drafter's output vocabulary from supervised-token counts.

The draft vocabulary is the ``draft_vocab_size`` most frequent supervised tokens, always
including the end-of-turn token(s) and ``</think>`` (rare per sample, but a drafter that
cannot propose them cannot finish a turn or an answer). Draft ids follow target-id order, so
``d2t`` (int64, ``target = draft + d2t[draft]``) is a non-decreasing offset table, the layout
EAGLE-3 checkpoints ship; ``t2d`` (bool over the target vocabulary) marks the chosen ids. At or
above the target vocabulary size the mapping is the identity.
Coverage = the share of supervised tokens inside the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3.durable import atomic_path


@dataclass(frozen=True)
class DraftVocab:
    d2t: np.ndarray  # int64 [draft]
    t2d: np.ndarray  # bool [target]
    coverage: float
    identity: bool


def must_keep(tokenizer) -> list[int]:
    """End-of-turn and end-of-reasoning ids the draft vocabulary always holds."""
    names = ["</think>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"]
    ids = {tokenizer.convert_tokens_to_ids(n) for n in names if n in tokenizer.get_vocab()}
    eos = tokenizer.eos_token_id
    ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return sorted(i for i in ids if i is not None and i >= 0)


def build(counts: np.ndarray, draft_size: int, keep: list[int]) -> DraftVocab:
    target = len(counts)
    total = int(counts.sum())
    if draft_size >= target:
        return DraftVocab(np.zeros(target, dtype=np.int64), np.ones(target, dtype=bool), 1.0, True)
    if len(keep) > draft_size:
        raise ValueError(f"vocab.draft_vocab_size={draft_size} cannot hold the {len(keep)} tokens that must be kept")
    order = np.argsort(-counts, kind="stable")  # ties broken by lower id: deterministic
    chosen = list(keep)
    taken = set(keep)
    for tid in order:
        if len(chosen) == draft_size:
            break
        if int(tid) not in taken:
            chosen.append(int(tid))
            taken.add(int(tid))
    draft_ids = np.array(sorted(chosen), dtype=np.int64)
    t2d = np.zeros(target, dtype=bool)
    t2d[draft_ids] = True
    coverage = float(counts[draft_ids].sum() / total) if total else 0.0
    return DraftVocab(draft_ids - np.arange(draft_size, dtype=np.int64), t2d, coverage, False)


def save(vocab: DraftVocab, path: Path) -> None:
    from safetensors.numpy import save_file

    with atomic_path(path) as tmp:
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(tmp))


def load(path: Path) -> tuple[np.ndarray, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]


def sum_counts(paths: list[Path], size: int) -> np.ndarray:
    from safetensors.numpy import load_file

    total = np.zeros(size, dtype=np.int64)
    for p in paths:
        counts = load_file(str(p))["counts"]
        if len(counts) != size:
            raise ValueError(
                f"{p}: counts cover {len(counts)} ids, the tokenizer has {size}: shards were tokenized with "
                "another tokenizer"
            )
        total += counts
    return total
