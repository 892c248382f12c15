"""The optimizers of [train] (``train.optimizer``): AdamW, or Muon for the drafter's weight matrices with AdamW
for the rest.

Design choices:
- One ``torch.optim.Optimizer`` for both kinds of parameter (param groups flagged ``muon``), so the
  trainer's learning-rate schedule (it sets every group's ``lr``), its checkpoint (``state_dict``, keyed by
  parameter index like AdamW's) and its resume work unchanged.
- Muon: heavy-ball momentum 0.95 with Nesterov, then the update matrix orthogonalised by a quintic
  Newton-Schulz iteration (5 steps, coefficients 3.4445, -4.7750, 2.0315: singular values pushed towards
  1 without computing an SVD), then scaled by 0.2 x sqrt(max(rows, cols)), which gives the update about the
  RMS of an AdamW update, so AdamW's learning rate and weight decay carry over (Moonshot's rule).
- Which tensors: 2-D weights that feed a matmul inside the drafter (fc and the decoder layer's q/k/v/o and
  MLP). lm_head (an output head) and the norm vectors stay on AdamW, as Muon's authors advise.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MOMENTUM = 0.95
BETAS = (0.9, 0.95)  # AdamW's, both optimizers
EPS = 1e-8


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """``update`` with its singular values moved near 1 (quintic Newton-Schulz on the wide orientation)."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and not name.startswith(("lm_head", "embed_tokens"))


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups flagged ``muon``, AdamW on the others (same lr and weight decay)."""

    def __init__(self, groups: list[dict], lr: float, weight_decay: float):
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["muon"]:
                    self._muon(p, state, lr, decay)
                else:
                    self._adamw(p, state, lr, decay)
        return None

    @staticmethod
    def _muon(p, state, lr: float, decay: float) -> None:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.mul_(MOMENTUM).add_(p.grad)
        update = orthogonalise(p.grad.add(buf, alpha=MOMENTUM))
        p.mul_(1 - lr * decay)
        p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    @staticmethod
    def _adamw(p, state, lr: float, decay: float) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        t, (b1, b2) = float(state["step"]), BETAS
        state["exp_avg"].lerp_(p.grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        p.mul_(1 - lr * decay)
        denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(EPS)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**t))


def build(model: torch.nn.Module, trainable: list[torch.Tensor], tc) -> torch.optim.Optimizer:
    """train.optimizer over ``trainable`` (the parameters that train, in the model's order)."""
    if tc.optimizer == "adamw":
        return torch.optim.AdamW(trainable, lr=tc.learning_rate, betas=BETAS, weight_decay=tc.weight_decay)
    wanted = {id(p) for p in trainable}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in wanted]
    groups = [
        {"params": [p for n, p in named if is_muon_matrix(n, p)], "muon": True},
        {"params": [p for n, p in named if not is_muon_matrix(n, p)], "muon": False},
    ]
    return MuonAdamW([g for g in groups if g["params"]], tc.learning_rate, tc.weight_decay)
