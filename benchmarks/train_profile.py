"""Where a training step's CPU time goes, from a torch.profiler trace recorded with shapes.

Every op's self time is given to what it works on, read from its input shapes: an op touching the
target vocabulary (49,152 ids at SmolLM2's shapes) is the target head; a matrix product with the
draft vocabulary is the draft lm_head (forward and backward); an op on the lm_head weight itself
([D, H]: its gradient sums over the TTT steps, AdamW's update) is counted apart; any other op over
the draft vocabulary is the loss (softmax, log-softmax, the soft cross-entropy and their gradients);
an op on [B, heads, T, ...] tensors is attention; the rest is the drafter layer (fc, q/k/v/o, MLP,
norms), the other parameters' AdamW updates (torch's CPU AdamW is plain tensor ops) and the stage's
own work (collate, copies). Only meaningful when the two vocabularies differ from each other and
from every other dimension.
"""

from __future__ import annotations

from collections import defaultdict

MATMUL = ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm")


def category(name: str, shapes, target_vocab: int, draft_vocab: int, heads: int, hidden: int) -> str:
    dims = [d for s in shapes or [] if isinstance(s, list) for d in s if isinstance(d, int)]
    four_d = [s for s in shapes or [] if isinstance(s, list) and len(s) == 4 and s[1] == heads]
    op = name.split("::")[-1]
    if "adam" in op.lower() or op.startswith("_foreach") or "clip" in op:
        return "optimizer"
    if target_vocab in dims:
        return "target head (logits over the target vocab)"
    if draft_vocab in dims and op not in MATMUL and [draft_vocab, hidden] in shapes:
        return "draft lm_head weight (gradient sums, AdamW)"
    if draft_vocab in dims:
        return "draft lm_head (matmuls)" if op in MATMUL else "loss over the draft vocab"
    if four_d:
        return "attention"
    return "drafter layer and the rest"


def breakdown(prof, target_vocab: int, draft_vocab: int, heads: int, hidden: int) -> dict:
    """{"seconds": {category: self CPU s}, "share": {category: fraction}} over the aten ops."""
    seconds = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        if not event.key.startswith("aten::"):
            continue
        cat = category(event.key, event.input_shapes, target_vocab, draft_vocab, heads, hidden)
        seconds[cat] += event.self_cpu_time_total / 1e6
    total = sum(seconds.values()) or 1.0
    ordered = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    return {
        "seconds": {k: round(v, 3) for k, v in ordered.items()},
        "share": {k: round(v / total, 4) for k, v in ordered.items()},
    }
