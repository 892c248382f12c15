"""Random-but-shaped weights that make the tiny model act like a reasoning model.

Plain random weights almost never sample ``</think>`` or the end-of-turn token,
so every completion would end by length. Three reserved residual channels fix
that while the other 125 dims stay random (so the target is a non-trivial
function of its context that a drafter can learn, not a constant):

* ``BIAS`` - every embedding holds the same constant here and no block writes
  to it, so the final norm passes a near-constant value to ``lm_head``; the
  lm_head column for it is a per-token logit offset (corpus unigram prior,
  and a large negative offset for tokens that must never be generated).
* ``TRIGGER`` - non-zero only in the embeddings of the arch's answer triggers
  (``</think>``; for llama also ``<|end_header_id|>``).
* ``ANSWER`` - written by one layer-0 attention head whose query is constant
  and whose key is the trigger flag; both live on the lowest-frequency rotary
  pair, where RoPE turns them by < 0.02 rad over 4k positions, so the head
  finds a trigger anywhere in the context with ~all its attention and copies
  a fixed value into ANSWER. No trigger -> uniform attention over zero values.

lm_head then gives end-of-turn a hugely negative logit before a trigger and a
calibrated one after it, and ``</think>`` the reverse, so samples read
"reasoning </think> answer <eot>". The random blocks neither read nor write the
reserved channels, which keeps them clean through the residual stream.
Every tensor comes from one seeded ``torch.Generator`` in a fixed order, so
builds are byte-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3.tiny.specs import HEAD_DIM, HIDDEN_SIZE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

BIAS, TRIGGER, ANSWER = HIDDEN_SIZE - 1, HIDDEN_SIZE - 2, HIDDEN_SIZE - 3
RESERVED = (ANSWER, TRIGGER, BIAS)
CONTENT = HIDDEN_SIZE - len(RESERVED)

# Rotary pairs are (i, i + HEAD_DIM/2); i = HEAD_DIM/2 - 1 turns slowest.
SLOW_DIM = HEAD_DIM // 2 - 1
DETECT_Q_HEAD = NUM_HEADS - 1
DETECT_KV_HEAD = NUM_KV_HEADS - 1
IDLE_Q_HEAD = NUM_HEADS - 2  # shares DETECT_KV_HEAD under GQA; silenced


@dataclass(frozen=True)
class Knobs:
    """Magnitudes, calibrated with the sampling loop in tests/unit/test_tiny.py."""

    seed: int = 1234
    bias_value: float = 4.0
    trigger_value: float = 4.0
    answer_value: float = 4.0
    block_gain: float = 1.0
    content_logit_std: float = 2.5
    unigram_weight: float = 0.6
    think_end_logit: float = 0.0
    eot_logit: float = 0.0
    forbidden_logit: float = -40.0
    detect_norm_gain: float = 2.3


@dataclass(frozen=True)
class TokenRoles:
    """Token ids the weight shaping treats specially."""

    eos: int
    think_end: int
    triggers: tuple[int, ...]
    forbidden: tuple[int, ...]


def build_state_dict(model_type: str, vocab_size: int, roles: TokenRoles, unigram, knobs: Knobs = Knobs()):
    """All tensors (float32) of a Qwen3/Llama causal LM, keyed by HF names."""
    import torch

    gen = torch.Generator().manual_seed(knobs.seed)
    sd = {"model.embed_tokens.weight": embeddings(gen, vocab_size, roles, knobs)}
    for layer in range(NUM_LAYERS):
        sd.update(layer_tensors(gen, layer, model_type, knobs))
    sd["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    sd["lm_head.weight"] = lm_head(gen, vocab_size, roles, unigram, knobs)
    return sd


def embeddings(gen, vocab_size: int, roles: TokenRoles, knobs: Knobs):
    import torch

    emb = torch.zeros(vocab_size, HIDDEN_SIZE)
    emb[:, :CONTENT] = torch.randn(vocab_size, CONTENT, generator=gen)
    emb[:, BIAS] = knobs.bias_value
    emb[list(roles.triggers), TRIGGER] = knobs.trigger_value
    return emb


def random_matrix(gen, rows: int, cols: int, gain: float):
    """Gaussian weights that read and write only the content channels."""
    import torch

    w = torch.zeros(rows, cols)
    r = min(rows, CONTENT) if rows == HIDDEN_SIZE else rows
    c = min(cols, CONTENT) if cols == HIDDEN_SIZE else cols
    w[:r, :c] = torch.randn(r, c, generator=gen) * (gain / math.sqrt(c))
    return w


def layer_tensors(gen, layer: int, model_type: str, knobs: Knobs):
    import torch

    p = f"model.layers.{layer}."
    q_out, kv_out, inter = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, 4 * HIDDEN_SIZE // 2
    g = knobs.block_gain
    t = {
        p + "self_attn.q_proj.weight": random_matrix(gen, q_out, HIDDEN_SIZE, 1.0),
        p + "self_attn.k_proj.weight": random_matrix(gen, kv_out, HIDDEN_SIZE, 1.0),
        p + "self_attn.v_proj.weight": random_matrix(gen, kv_out, HIDDEN_SIZE, 1.0),
        p + "self_attn.o_proj.weight": random_matrix(gen, HIDDEN_SIZE, q_out, g),
        p + "mlp.gate_proj.weight": random_matrix(gen, inter, HIDDEN_SIZE, 1.0),
        p + "mlp.up_proj.weight": random_matrix(gen, inter, HIDDEN_SIZE, 1.0),
        p + "mlp.down_proj.weight": random_matrix(gen, HIDDEN_SIZE, inter, g),
        p + "input_layernorm.weight": torch.ones(HIDDEN_SIZE),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
    }
    if model_type == "qwen3":
        t[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
    if layer == 0:
        install_detector(t, p, model_type, knobs)
    return t
