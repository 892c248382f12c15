"""The few target tensors training needs, read straight from its safetensors files.

The drafter copies the target's embeddings (frozen) and the draft-vocabulary rows of its
``lm_head``; the loss needs the target's next-token distribution, which is its final norm and
``lm_head`` applied to the stored last-layer state (taken before the final norm, so the norm is
applied here). Only these tensors are read (``safe_open`` per file), never the whole model.

A tied target (SmolLM2, Gemma: ``tie_word_embeddings``) stores no ``lm_head.weight``; its head is
the embedding. Whether a model ties is its config's key, and where the config leaves the key out,
the architecture's default as transformers applies it when loading the model (Llama and Qwen3:
untied; Gemma: tied) -- the same answer the served model gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3.errors import InputError


class TargetWeightsError(InputError, ValueError):
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
        return TargetHead(
            self.embed.to(device), self.norm_weight.to(device), self.lm_head.to(device), self.eps, self.config
        )


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


def ties_embeddings(folder: Path, config: dict) -> bool:
    """Whether the model in ``folder`` uses its embedding as its lm_head."""
    text = config.get("text_config") or config
    for declared in (text.get("tie_word_embeddings"), config.get("tie_word_embeddings")):
        if declared is not None:
            return bool(declared)
    return architecture_ties(folder)


def architecture_ties(folder: Path) -> bool:
    """transformers' default for this config's architecture; False when transformers cannot read it
    (a model it cannot load has no default we could trust)."""
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError):
        return False
    text = loaded.get_text_config()
    return bool(getattr(text, "tie_word_embeddings", getattr(loaded, "tie_word_embeddings", False)))


def load_target_head(model_path: str) -> TargetHead:
    """The target's embedding, final norm weight and lm_head, from a local model folder (resolve a
    hub id or ``tiny:`` spec with ``eagle3.models.resolve_model`` first)."""
    folder = Path(model_path)
    if not (folder / "config.json").exists():
        raise TargetWeightsError(
            f"{folder}: no config.json (training reads the target's embeddings and head from a local folder)"
        )
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    prefixes = ("model.", "model.language_model.", "language_model.model.")
    wanted = [p + n for p in prefixes for n in ("embed_tokens.weight", "norm.weight")] + [
        "lm_head.weight",
        "language_model.lm_head.weight",
    ]
    found = _find(folder, wanted)

    def first(*names):
        return next((found[n] for n in names if n in found), None)

    embed = first(*(p + "embed_tokens.weight" for p in prefixes))
    norm = first(*(p + "norm.weight" for p in prefixes))
    head = first("lm_head.weight", "language_model.lm_head.weight")
    if head is None and embed is not None and ties_embeddings(folder, config):
        head = embed
    missing = [
        n for n, t in (("embed_tokens.weight", embed), ("norm.weight", norm), ("lm_head.weight", head)) if t is None
    ]
    if missing:
        untied = (
            (
                " (and config.json does not tie it to the embedding: tie_word_embeddings is false or, left out, "
                "false for this architecture)"
            )
            if head is None and embed is not None
            else ""
        )
        raise TargetWeightsError(
            f"{folder}: the target's weights have no {', '.join(missing)} (looked under {', '.join(prefixes)}){untied}"
        )
    return TargetHead(embed, norm, head, float(text.get("rms_norm_eps", 1e-6)), config)


LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def load_target_layer(model_path: str, layer: int, qk_norms: bool) -> dict[str, torch.Tensor]:
    """Decoder layer ``layer``'s tensors (names as in LAYER_TENSORS, plus QK_NORMS when ``qk_norms``), for
    train.warm_start = target_layer; the error names the layer and what is missing."""
    folder = Path(model_path)
    prefixes = ("model.", "model.language_model.", "language_model.model.")
    names = [*LAYER_TENSORS, *(QK_NORMS if qk_norms else ())]
    found = _find(folder, [f"{p}layers.{layer}.{n}" for p in prefixes for n in names])
    out = {}
    for n in names:
        tensor = next((found[k] for p in prefixes if (k := f"{p}layers.{layer}.{n}") in found), None)
        if tensor is not None:
            out[n] = tensor
    missing = [n for n in names if n not in out]
    if missing:
        raise TargetWeightsError(
            f"{folder}: train.warm_start = target_layer needs decoder layer {layer}'s {', '.join(missing)}, "
            "which the target's weights do not hold (is the layer id past the model's last layer?)"
        )
    return out
