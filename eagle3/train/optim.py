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
- The AdamW half is torch's functional ``adamw``; the Muon half is written here, since torch's ``Muon``
  is an optimizer of its own (two optimizers would split the checkpoint and the schedule) and its
  Newton-Schulz is private.
- Which tensors: 2-D weights that feed a matmul inside the drafter (fc and the decoder layer's q/k/v/o and
  MLP). lm_head (an output head) and the norm vectors stay on AdamW, as Muon's authors advise.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw as adamw_update  # torch's AdamW step, functional

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
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                for p in params:
                    self._muon(p, self.state[p], lr, decay)
            else:
                self._adamw(params, lr, decay)
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

    def _adamw(self, params: list[torch.Tensor], lr: float, decay: float) -> None:
        """torch's own AdamW update (its functional form), on state kept under AdamW's keys."""
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        states = [self.state[p] for p in params]
        adamw_update(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            amsgrad=False,
            beta1=BETAS[0],
            beta2=BETAS[1],
            lr=lr,
            weight_decay=decay,
            eps=EPS,
            maximize=False,
        )


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
