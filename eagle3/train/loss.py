"""The TTT loss and the offline acceptance metrics.

Step k at position t predicts the token at t+2+k; its target is the target model's distribution
at position t+1+k (which predicts that same token), restricted to the draft vocabulary and
renormalised. A position counts when the token it predicts is supervised (loss mask 1) and lies
inside the sequence; it is left out of the loss (kept in the metrics as a miss) when the target's
top-1 token is outside the draft vocabulary, which the drafter cannot propose.

Loss = sum_k w^k * (sum of soft cross-entropies at step k) / N_k, where N_k is the number of
counted positions of step k in the whole *global* batch (all micro-batches of the optimizer step,
all processes), so that gradient accumulation and DDP give the same update as one process seeing
the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.drafter.model import shift_left


@dataclass
class TargetView:
    """The target's side of one micro-batch, restricted to the draft vocabulary."""

    draft_logits: torch.Tensor  # [B, T, D] target logits at the draft vocab's target ids
    top1: torch.Tensor  # [B, T] the target's argmax (target ids)
    top1_in_draft: torch.Tensor  # [B, T] bool


def target_view(target_logits: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> TargetView:
    draft_to_target = torch.arange(len(d2t), device=d2t.device) + d2t
    top1 = target_logits.argmax(-1)
    return TargetView(target_logits[..., draft_to_target], top1, t2d[top1])


def step_positions(loss_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per step k, the positions t whose predicted token (t+2+k) is supervised: [B, T] bool."""
    return [shift_left(loss_mask, 2 + k).bool() for k in range(steps)]


def ttt_loss(
    logits: list[torch.Tensor],
    view: TargetView,
    loss_mask: torch.Tensor,
    d2t: torch.Tensor,
    weight_decay: float,
    global_counts: list[int],
) -> tuple[torch.Tensor, dict]:
    """(loss to backpropagate, per-step sums for logging and metrics)."""
    draft_to_target = torch.arange(len(d2t), device=d2t.device) + d2t
    total = logits[0].new_zeros(())
    stats = {"ce_sum": [], "counted": [], "correct": [], "chain": [], "positions": []}
    chain = None
    for k, (q, pos) in enumerate(zip(logits, step_positions(loss_mask, len(logits)))):
        tgt = shift_left(view.draft_logits, 1 + k)
        in_draft = shift_left(view.top1_in_draft, 1 + k, fill=False)
        top1 = shift_left(view.top1, 1 + k)
        counted = pos & in_draft
        p = torch.softmax(tgt.float(), dim=-1)
        ce = -(p * torch.log_softmax(q.float(), dim=-1)).sum(-1)
        ce_sum = (ce * counted).sum()
        total = total + (weight_decay**k) * ce_sum / max(global_counts[k], 1)
        correct = (draft_to_target[q.argmax(-1)] == top1) & counted
        chain = correct if chain is None else (chain & correct)
        stats["ce_sum"].append(float(ce_sum.detach()))
        stats["counted"].append(int(counted.sum()))
        stats["correct"].append(int((correct & pos).sum()))
        stats["chain"].append(int((chain & pos).sum()))
        stats["positions"].append(int(pos.sum()))
    return total, stats


def summarize(stats_list: list[dict], steps: int) -> dict:
    """Per-step accuracy, conditional accuracy and expected acceptance length of a K-chain.

    accuracy_k = P(step k right); conditional_k = P(step k right | steps < k right);
    acceptance_length = 1 + sum_k P(steps 0..k all right) -- the bonus token the target always
    adds plus the expected accepted drafts under greedy verification (what vLLM's mean acceptance
    length reports)."""
    sums = {
        key: [sum(s[key][k] for s in stats_list) for k in range(steps)]
        for key in ("ce_sum", "counted", "correct", "chain", "positions")
    }
    pos0 = max(sums["positions"][0], 1)
    accuracy = [sums["correct"][k] / max(sums["positions"][k], 1) for k in range(steps)]
    conditional = [accuracy[0]] + [sums["chain"][k] / max(sums["chain"][k - 1], 1) for k in range(1, steps)]
    chain_rate = [sums["chain"][k] / pos0 for k in range(steps)]
    return {
        "loss_per_step": [sums["ce_sum"][k] / max(sums["counted"][k], 1) for k in range(steps)],
        "accuracy": accuracy,
        "conditional_accuracy": conditional,
        "acceptance_length": 1 + sum(chain_rate),
        "positions": sums["positions"][0],
    }
