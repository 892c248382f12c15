"""The few target tensors training needs, read straight from its safetensors files.

The drafter copies the target's embeddings (frozen) and the draft-vocabulary rows of its
``lm_head``; the loss needs the target's next-token distribution, which is its final norm and
``lm_head`` applied to the stored last-layer state (taken before the final norm, so the norm is
applied here). Only these tensors are read (``safe_open`` per file), never the whole model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


class TargetWeightsError(ValueError):
    """The target's files lack a tensor training needs."""


@dataclass
class TargetHead:
    embed: torch.Tensor  # [V, H]
    norm_weight: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    eps: float
    config: dict

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """Target logits [.., V] (float32) from last-layer states taken before the final norm."""
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return F.linear(x * self.norm_weight.float(), self.lm_head.float())

    def to(self, device) -> TargetHead:
        return TargetHead(self.embed.to(device), self.norm_weight.to(device), self.lm_head.to(device), self.eps, self.config)


def _find(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {n: folder / weight_map[n] for n in names if n in weight_map}
    else:
        files = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                for n in names:
                    if n in fh.keys():
                        files.setdefault(n, f)
    found = {}
    for name, f in files.items():
        with safe_open(str(f), framework="pt") as fh:
            found[name] = fh.get_tensor(name)
    return found


def load_target_head(model_path: str) -> TargetHead:
    folder = Path(model_path)
    if not (folder / "config.json").exists():
        raise TargetWeightsError(f"{folder}: no config.json (training reads the target's embeddings and head from a local folder)")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    prefixes = ("model.", "model.language_model.", "language_model.model.")
    wanted = [p + n for p in prefixes for n in ("embed_tokens.weight", "norm.weight")] + ["lm_head.weight", "language_model.lm_head.weight"]
    found = _find(folder, wanted)

    def first(*names):
        return next((found[n] for n in names if n in found), None)

    embed = first(*(p + "embed_tokens.weight" for p in prefixes))
    norm = first(*(p + "norm.weight" for p in prefixes))
    head = first("lm_head.weight", "language_model.lm_head.weight")
    if head is None and text.get("tie_word_embeddings", config.get("tie_word_embeddings")):
        head = embed
    missing = [n for n, t in (("embed_tokens.weight", embed), ("norm.weight", norm), ("lm_head.weight", head)) if t is None]
    if missing:
        raise TargetWeightsError(f"{folder}: the target's weights have no {', '.join(missing)} (looked under {', '.join(prefixes)})")
    return TargetHead(embed, norm, head, float(text.get("rms_norm_eps", 1e-6)), config)
