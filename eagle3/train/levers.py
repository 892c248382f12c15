"""The sample-efficiency levers of [train] that change what training starts from or sees.

- ``start``: train.freeze_lm_head, and through ``warm_start`` train.warm_start = "target_layer" (the
  drafter's decoder layer from a target layer; Eagle3Drafter.warm_start_from_layer says which tensor goes
  where).
- ``noisy``: train.hidden_noise (noise on the tapped states, training steps only). The noise is a pure
  function of (seed, step, the micro-batch's sample ids), so a resumed run draws exactly what the
  uninterrupted one drew, and it scales with each token's RMS over the tapped states, so one value suits
  targets of any hidden-state scale. Padding is left alone.
"""

from __future__ import annotations

import zlib

import torch


def start(model, tc, model_path: str, layer_ids: list[int], final_norm: torch.Tensor, log) -> None:
    """What the drafter starts from, after init_from_target: train.warm_start and train.freeze_lm_head."""
    if tc.warm_start == "target_layer":
        warm_start(model, tc, model_path, layer_ids, final_norm, log)
    if tc.freeze_lm_head:  # stays at the target's rows of the draft vocabulary
        model.lm_head.weight.requires_grad_(False)


def warm_start(model, tc, model_path: str, layer_ids: list[int], final_norm: torch.Tensor, log) -> None:
    from eagle3.train.target import load_target_layer

    top = max(layer_ids)
    layer = tc.warm_start_layer if tc.warm_start_layer is not None else top
    tensors = load_target_layer(model_path, layer, qk_norms=model.config.arch == "qwen3")
    model.warm_start_from_layer(tensors, final_norm, layer_ids.index(top))
    log(f"warm start: the drafter's layer from target layer {layer}, fc passing aux id {top} through")


def noisy(aux: torch.Tensor, valid: torch.Tensor, tc, step: int, sample_ids: list[str]) -> torch.Tensor:
    """``aux`` [B, T, 3H] plus noise of scale tc.hidden_noise x each token's RMS, on valid tokens only."""
    key = zlib.crc32(f"{tc.seed}:{step}:{','.join(sample_ids)}".encode())
    gen = torch.Generator().manual_seed(key)
    scale = tc.hidden_noise * aux.pow(2).mean(-1, keepdim=True).sqrt()
    if tc.hidden_noise_kind == "uniform":
        noise = torch.rand(aux.shape, generator=gen) * 2 - 1
    else:
        noise = torch.randn(aux.shape, generator=gen)
    return aux + noise.to(aux.device) * scale * valid[..., None]
