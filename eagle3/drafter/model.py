"""The EAGLE-3 drafter, built to compute exactly what vLLM's EAGLE-3 drafter computes.

One decoder layer (Llama- or Qwen3-style, to match the target family) whose attention reads
``[input_layernorm(embedding), hidden_norm(hidden)]`` (2H wide); ``fc`` fuses the target's three
auxiliary states (3 x target H -> H) into the first step's hidden input; after the MLP the
residual stream goes through the final ``norm`` into ``lm_head`` over the draft vocabulary. The
residual stream *before* that norm is the hidden input of the next drafting step (vLLM passes its
pre-norm output on). Embeddings come from the target and stay frozen.

EAGLE-3.1's variants, as vLLM 0.32 serves them (model_executor/models/llama_eagle3.py): ``norm_before_fc``
adds ``input_norm``, one RMSNorm over the concatenated aux states before ``fc``; ``norm_output`` hands the
*post*-norm state to the next step instead.

``norm_before_residual``: where the residual branch taps the hidden input -- after
``hidden_norm`` (True) or before it (False, the default here, as in EAGLE-3's reference code).
vLLM's two checkpoint layouts default it differently, so the export always writes it.

Parameter names are the EAGLE checkpoint layout's (``midlayer.*``, ``fc``, ``norm``,
``lm_head``), so the exported state dict is this module's, minus the frozen embeddings when the
target's are shared.

Training-time test (TTT): ``ttt_logits`` unrolls K drafting steps over a whole sequence at once.
Step k at position t reads the token ``x[t+1+k]`` and the hidden output of step k-1 at t (step
0: ``fc(aux[t])``), sits at position ``t+k`` (as vLLM advances positions while drafting), and
attends to step 0's keys at positions <= t (the context the drafter's cache holds when serving)
plus its own chain (steps 1..k at t) -- the mask each step needs, built explicitly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterConfig:
    arch: str  # "llama" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    norm_before_residual: bool = False
    target_model_type: str = "llama"
    # EAGLE-3.1's two norms (vLLM reads both): an RMSNorm over the concatenated aux states before fc
    # (``input_norm``), and the post-norm output (not the pre-norm residual) handed to the next step.
    norm_before_fc: bool = False
    norm_output: bool = False
    target_architecture: str = ""

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        norm_output: bool = False,
    ) -> DrafterConfig:
        """The drafter's shapes from the target's config.json (the drafter layer mirrors a target layer)."""
        text = target_config.get("text_config", target_config)
        model_type = text.get("model_type", "llama")
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        return cls(
            arch="qwen3" if model_type.startswith("qwen3") else "llama",
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            norm_before_residual=norm_before_residual,
            norm_before_fc=norm_before_fc,
            norm_output=norm_output,
            target_model_type=model_type,
            target_architecture=(target_config.get("architectures") or [""])[0],
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> DrafterConfig:
        return cls(**json.loads(Path(path).read_text()))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, as Llama/Qwen3): x [B, heads, T, d], positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        if c.arch == "qwen3":
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        if c.arch == "qwen3":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def chain_attention(self, q, k0, v0, chain_k: list, chain_v: list, key_mask: torch.Tensor) -> torch.Tensor:
        """q [B,h,T,d] attends to k0/v0 at positions <= t (and valid) plus, at its own position,
        every chain key in ``chain_k`` (steps 1..k, including itself)."""
        B, h, T, d = q.shape
        scale = 1.0 / math.sqrt(d)
        scores = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B,h,T,T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        allowed = causal[None, None] & key_mask[:, None, None, :]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        diag = [((q * k).sum(-1) * scale)[..., None] for k in chain_k]  # [B,h,T,1] each
        weights = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.matmul(weights[..., :T], v0)
        for j, v in enumerate(chain_v):
            out = out + weights[..., T + j : T + j + 1] * v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, h * d))


class MLP(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """(2H attention input, residual) as vLLM's first EAGLE-3 layer builds them."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.c.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after the MLP: the pre-norm output vLLM hands to the next step."""
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Drafter(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer(
            "t2d",
            torch.ones(c.vocab_size, dtype=torch.bool)
            if c.draft_vocab_size >= c.vocab_size
            else torch.zeros(c.vocab_size, dtype=torch.bool),
        )

    def init_from_target(
        self, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor
    ) -> None:
        """Frozen target embeddings; lm_head rows of the draft vocabulary's target ids."""
        draft_to_target = torch.arange(len(d2t)) + d2t
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head[draft_to_target])
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def warm_start_from_layer(self, layer: dict[str, torch.Tensor], final_norm: torch.Tensor, slot: int) -> None:
        """Start step 0 as the target's own decoder layer (``layer``: eagle3.train.target.load_target_layer) on
        the top tapped state: fc passes that state through, the hidden half of q/k/v and everything after the
        attention are the target layer's, the hidden and input norms its input norm, the final norm the
        target's. The embedding half of q/k/v keeps its random start (the target layer has no such input).
        ``slot``: which of fc's three inputs (the aux states in layer-id order) is passed through."""
        c = self.config
        H, Ht = c.hidden_size, c.target_hidden_size
        if H != Ht:
            raise ValueError(f"warm start needs the drafter's hidden size ({H}) to be the target's ({Ht})")
        attn, mid = self.midlayer.self_attn, self.midlayer
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, slot * Ht : (slot + 1) * Ht].copy_(torch.eye(H))
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(attn, name).weight[:, H:].copy_(layer[f"self_attn.{name}.weight"])
            attn.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mid.mlp, name).weight.copy_(layer[f"mlp.{name}.weight"])
            mid.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
            mid.input_layernorm.weight.copy_(layer["input_layernorm.weight"])
            mid.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
            if c.arch == "qwen3":
                attn.q_norm.weight.copy_(layer["self_attn.q_norm.weight"])
                attn.k_norm.weight.copy_(layer["self_attn.k_norm.weight"])
            self.norm.weight.copy_(final_norm)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    def forward(self, input_ids: torch.Tensor, aux: torch.Tensor, valid: torch.Tensor, steps: int, head=None) -> list:
        return self.ttt_logits(input_ids, aux, valid, steps, head)

    def ttt_logits(
        self, input_ids: torch.Tensor, aux: torch.Tensor, valid: torch.Tensor, steps: int, head=None
    ) -> list:
        """Draft logits [B, T, draft_vocab] for each of ``steps`` TTT steps (see module doc).

        input_ids [B,T] (the data tokens), aux [B,T,3H_target], valid [B,T] bool (real tokens).
        ``head(step, normed_hidden, lm_head_weight)``, when given, replaces the lm_head and its
        result is returned per step instead of the logits (the chunked loss: see train.chunked)."""
        B, T = input_ids.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        aux = aux.to(self.fc.weight.dtype)
        hidden = self.fc(self.input_norm(aux) if self.config.norm_before_fc else aux)
        base = torch.arange(T, device=input_ids.device)
        k0 = v0 = None
        chain_k, chain_v, out = [], [], []
        for step in range(steps):
            tokens = shift_left(input_ids, 1 + step)
            x, residual = layer.attn_input(self.embed_tokens(tokens), hidden)
            q, k, v = attn.qkv(x, base + step)
            if step == 0:
                k0, v0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            a = attn.chain_attention(q, k0, v0, chain_k, chain_v, valid)
            hidden = layer.after_attention(a, residual)
            normed = self.norm(hidden)
            out.append(self.lm_head(normed) if head is None else head(step, normed, self.lm_head.weight))
            if self.config.norm_output:  # EAGLE-3.1: the next step reads the post-norm state
                hidden = normed
        return out


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t+n] at t, ``fill`` past the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out
