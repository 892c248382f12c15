"""The TTT loss over the draft vocabulary without the full logits: the same numbers, less memory.

The plain path (``loss.ttt_loss``) takes each step's logits [B, T, D] from the drafter's lm_head and
keeps, per step, the logits, their log-softmax and the target distribution for backward: at
SmolLM2's shapes with a 32k draft vocabulary and K = 7 that is 3 x 7 fp32 [T, 32k] tensors, ~5.6 GB
for 2,048 tokens. Here the lm_head and the soft cross-entropy run together, ``chunk`` rows at a time
and only on the counted rows (a supervised next token inside the sequence whose target top-1 is in
the draft vocabulary; every other row adds nothing to the loss or the metrics). Each chunk's
gradient is computed at once, as the loss is a fixed weighted sum of the rows' cross-entropies:
d ce / d q = softmax(q) * sum(p) - p, so backward only scales the kept gradients (of the lm_head
input [N, H] and weight [D, H]) by the incoming one. The target head likewise runs ``chunk`` rows at
a time, so the fp32 logits over the whole target vocabulary never exist for more than a chunk.

Under CUDA autocast the matmuls run in its dtype, as the plain path's lm_head does; the softmax
and the cross-entropy run in float32 on both paths.
"""

from __future__ import annotations

import torch

from eagle3.train.loss import TargetView, step_positions


def chunked_target_view(head, last: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, chunk: int) -> TargetView:
    """``loss.target_view(head.logits(last), d2t, t2d)``, ``chunk`` rows of logits at a time."""
    B, T, H = last.shape
    flat = last.reshape(B * T, H)
    draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t
    draft_logits = torch.empty(B * T, len(d2t), device=last.device)
    top1 = torch.empty(B * T, dtype=torch.long, device=last.device)
    for start in range(0, B * T, chunk):
        logits = head.logits(flat[start : start + chunk])
        top1[start : start + chunk] = logits.argmax(-1)
        draft_logits[start : start + chunk] = logits[:, draft_ids]
    top1 = top1.view(B, T)
    return TargetView(draft_logits.view(B, T, -1), top1, t2d[top1])


class _HeadSoftCE(torch.autograd.Function):
    """sum_i w_i * ce(softmax(target_i), h_i W^T) over rows i, with the argmax of each row's logits."""

    @staticmethod
    def forward(ctx, h, weight, target, row_weight, chunk: int, need_grad: bool):
        amp = torch.is_autocast_enabled(h.device.type)
        mm = torch.get_autocast_dtype(h.device.type) if amp else h.dtype
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(mm)
            ce = torch.empty(h.shape[0], device=h.device)
            top = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
            grad_h = torch.empty_like(h) if need_grad else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None
            for start in range(0, h.shape[0], chunk):
                rows = slice(start, start + chunk)
                x = h[rows].to(mm)
                q = (x @ w.T).float()
                p = torch.softmax(target[rows].float(), dim=-1)
                p_sum = p.sum(-1)
                dot = torch.linalg.vecdot(p, q)
                peak, top[rows] = q.max(-1, keepdim=True)[0], q.argmax(-1)
                e = q.sub_(peak).exp_()  # q is not needed past this point: reuse its memory
                total = e.sum(-1, keepdim=True)
                ce[rows] = (peak.squeeze(-1) + total.squeeze(-1).log()) * p_sum - dot
                if need_grad:  # (softmax(q) * sum(p) - p) * w, in place
                    w_row = row_weight[rows, None]
                    g = e.mul_(p_sum[:, None] * w_row / total).sub_(p.mul_(w_row)).to(mm)
                    grad_h[rows] = (g @ w).to(h.dtype)
                    if mm == torch.float32:
                        grad_w.addmm_(g.T, x)
                    else:
                        grad_w += (g.T @ x).float()
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(ce, top)
        return (ce * row_weight).sum(), ce, top

    @staticmethod
    def backward(ctx, grad_loss, _ce, _top):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None, None


class ChunkedTTTLoss:
    """Called by the drafter once per TTT step with the lm_head input and weight (inside its forward,
    so DDP and FSDP see the weight used there); ``finish`` gives what ``loss.ttt_loss`` gives."""

    def __init__(
        self,
        view: TargetView,
        loss_mask: torch.Tensor,
        d2t: torch.Tensor,
        weight_decay: float,
        global_counts: list[int],
        steps: int,
        chunk: int,
    ):
        self.view, self.weight_decay, self.global_counts, self.chunk = view, weight_decay, global_counts, chunk
        self.draft_to_target = torch.arange(len(d2t), device=d2t.device) + d2t
        self.positions = step_positions(loss_mask, steps)

    def __call__(self, k: int, hidden: torch.Tensor, weight: torch.Tensor):
        B, T, H = hidden.shape
        pos = self.positions[k]
        # step k at t learns the target's distribution at t+1+k; a counted t has t+2+k < T
        in_draft = torch.zeros_like(pos)
        in_draft[:, : T - 1 - k] = self.view.top1_in_draft[:, 1 + k :]
        counted = pos & in_draft
        b, t = counted.nonzero(as_tuple=True)
        scale = (self.weight_decay**k) / max(self.global_counts[k], 1)
        row_weight = torch.full((len(b),), scale, device=hidden.device)
        need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        loss, ce, top = _HeadSoftCE.apply(
            hidden[b, t], weight, self.view.draft_logits[b, t + 1 + k], row_weight, self.chunk, need_grad
        )
        correct = torch.zeros_like(pos)
        correct[b, t] = self.draft_to_target[top] == self.view.top1[b, t + 1 + k]
        return loss, ce.sum(), counted, correct

    def finish(self, outputs: list) -> tuple[torch.Tensor, dict]:
        stats = {"ce_sum": [], "counted": [], "correct": [], "chain": [], "positions": []}
        total, chain = None, None
        for pos, (loss, ce_sum, counted, correct) in zip(self.positions, outputs):
            total = loss if total is None else total + loss
            chain = correct if chain is None else (chain & correct)
            stats["ce_sum"].append(float(ce_sum))
            stats["counted"].append(int(counted.sum()))
            stats["correct"].append(int((correct & pos).sum()))
            stats["chain"].append(int((chain & pos).sum()))
            stats["positions"].append(int(pos.sum()))
        return total, stats
