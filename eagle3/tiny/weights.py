"""Random-but-shaped weights that make the tiny model act like a reasoning model.

Plain random weights almost never sample ``</think>`` or the end-of-turn token,
so every completion would end by length. Four reserved residual channels fix
that while the other 124 dims stay random (so the target is a non-trivial
function of its context that a drafter can learn, not a constant):

* ``BIAS`` - every embedding holds the same constant here and no block writes
  to it, so the final norm passes a near-constant value to ``lm_head``; its
  lm_head column is a per-token logit offset: a corpus unigram prior, and a
  large negative offset for tokens that must never be generated.
* ``TRIGGER`` - non-zero only in the embeddings of the arch's answer triggers
  (``</think>``; for llama also ``<|end_header_id|>``).
* ``ANSWER`` / ``REASON`` - written by one layer-0 attention head whose query
  is constant and whose key is the trigger flag. Both live on the slowest
  rotary pair, which RoPE turns by < 0.02 rad over 4k positions, so once a
  trigger is anywhere in the context it takes ~all of the head's attention
  and its value lands in ANSWER. Before that the head averages uniformly over
  the other tokens, whose value lands in REASON. Each value is zero on the
  other kind of token (exactly: the weights are ratios of raw embedding
  values, which RMSNorm scales alike), so exactly one channel is on per mode.

lm_head reads REASON and ANSWER to give end-of-turn a hugely negative logit
while reasoning and a calibrated one while answering, and ``</think>`` the
reverse: samples read "reasoning </think> answer <eot>". Because each special
logit comes from a single channel, the final norm's per-position scale only
changes it proportionally (no large terms cancelling). The random blocks
neither read nor write reserved channels, which keeps them clean.
Every tensor comes from one seeded ``torch.Generator`` in a fixed order, so
builds are byte-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3.tiny.specs import HEAD_DIM, HIDDEN_SIZE, INTERMEDIATE_SIZE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

BIAS, TRIGGER, ANSWER, REASON = HIDDEN_SIZE - 1, HIDDEN_SIZE - 2, HIDDEN_SIZE - 3, HIDDEN_SIZE - 4
RESERVED = (REASON, ANSWER, TRIGGER, BIAS)
CONTENT = HIDDEN_SIZE - len(RESERVED)  # reserved dims sit on top, so [:CONTENT] is the random part

# Rotary pairs are (i, i + HEAD_DIM/2); i = HEAD_DIM/2 - 1 turns slowest.
SLOW_DIM = HEAD_DIM // 2 - 1
DETECT_Q_HEAD = NUM_HEADS - 1
DETECT_KV_HEAD = NUM_KV_HEADS - 1
IDLE_Q_HEAD = NUM_HEADS - 2  # shares DETECT_KV_HEAD under GQA; silenced


@dataclass(frozen=True)
class Knobs:
    """Magnitudes; the ``*_logit`` ones are logits (lm_head output).

    Calibrated with ``behaviour.measure`` (6 prompts x 10 samples, top_p 0.95,
    max_tokens 256, float32 HF, two seeds) on BUILD_VERSION 2:
      qwen3 T=0.6: stop 98-100%, all stops after exactly one </think>,
                   mean 91-103 tokens (~60 reasoning, ~32 answer)
      qwen3 T=1.0: stop 97-100%, same think rate, mean 105-107 tokens
      qwen3 greedy, 6 prompts x <=128: 663 tokens, 256 distinct, top one 4%
      llama (answers directly): stop 100%, mean 38 (T=0.6) / 51 (T=1.0)
    vLLM (bf16) agrees; see the report of the issue that added this.
    The reasoning length is steep in think_end_logit (T=0.6, roughly):
    3.0 -> ~80 tokens, 3.2 -> ~60, 3.4 -> ~40; eot_logit likewise for the answer.
    """

    seed: int = 1234
    bias_value: float = 4.0
    trigger_value: float = 4.0
    mode_value: float = 4.0
    block_gain: float = 1.0
    content_logit_std: float = 2.5
    unigram_weight: float = 0.6
    think_end_logit: float = 3.2
    eot_logit: float = 3.7
    forbidden_logit: float = -40.0
    detect_norm_gain: float = 2.3


@dataclass(frozen=True)
class TokenRoles:
    """Token ids the weight shaping treats specially."""

    eos: int
    think_end: int
    triggers: tuple[int, ...]
    forbidden: tuple[int, ...]


def build_state_dict(model_type: str, vocab_size: int, roles: TokenRoles, knobs: Knobs):
    """All tensors (float32) of a Qwen3/Llama causal LM, keyed by HF names.

    lm_head's reserved columns are still zero: ``shape_logits`` fills them
    once ``measure_reserved`` has seen what the final norm passes on.
    """
    import torch

    gen = torch.Generator().manual_seed(knobs.seed)
    sd = {"model.embed_tokens.weight": embeddings(gen, vocab_size, roles, knobs)}
    for layer in range(NUM_LAYERS):
        sd.update(layer_tensors(gen, layer, model_type, knobs))
    sd["model.norm.weight"] = torch.ones(HIDDEN_SIZE)
    sd["lm_head.weight"] = lm_head(gen, vocab_size, knobs)
    return sd


def embeddings(gen, vocab_size: int, roles: TokenRoles, knobs: Knobs):
    import torch

    emb = torch.zeros(vocab_size, HIDDEN_SIZE)
    emb[:, :CONTENT] = torch.randn(vocab_size, CONTENT, generator=gen)
    emb[:, BIAS] = knobs.bias_value
    emb[list(roles.triggers), TRIGGER] = knobs.trigger_value
    return emb


def random_matrix(gen, rows: int, cols: int, gain: float, *, reads: bool = False, writes: bool = False):
    """Gaussian weights; ``reads``/``writes`` the residual stream only in its content dims."""
    import torch

    w = torch.zeros(rows, cols)
    r = CONTENT if writes else rows
    c = CONTENT if reads else cols
    w[:r, :c] = torch.randn(r, c, generator=gen) * (gain / math.sqrt(c))
    return w


def layer_tensors(gen, layer: int, model_type: str, knobs: Knobs):
    import torch

    p = f"model.layers.{layer}."
    q_out, kv_out, inter = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, INTERMEDIATE_SIZE
    g = knobs.block_gain
    t = {
        p + "self_attn.q_proj.weight": random_matrix(gen, q_out, HIDDEN_SIZE, 1.0, reads=True),
        p + "self_attn.k_proj.weight": random_matrix(gen, kv_out, HIDDEN_SIZE, 1.0, reads=True),
        p + "self_attn.v_proj.weight": random_matrix(gen, kv_out, HIDDEN_SIZE, 1.0, reads=True),
        p + "self_attn.o_proj.weight": random_matrix(gen, HIDDEN_SIZE, q_out, g, writes=True),
        p + "mlp.gate_proj.weight": random_matrix(gen, inter, HIDDEN_SIZE, 1.0, reads=True),
        p + "mlp.up_proj.weight": random_matrix(gen, inter, HIDDEN_SIZE, 1.0, reads=True),
        p + "mlp.down_proj.weight": random_matrix(gen, HIDDEN_SIZE, inter, g, writes=True),
        p + "input_layernorm.weight": torch.ones(HIDDEN_SIZE),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN_SIZE),
    }
    if model_type == "qwen3":
        t[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
    if layer == 0:
        install_detector(t, p, model_type, knobs)
    return t


def embedding_rms(knobs: Knobs, trigger: bool) -> float:
    """Typical RMS of a (trigger) token's embedding, which layer 0's input norm divides by."""
    sq = CONTENT + knobs.bias_value**2 + (knobs.trigger_value**2 if trigger else 0.0)
    return math.sqrt(sq / HIDDEN_SIZE)


def install_detector(t: dict, p: str, model_type: str, knobs: Knobs) -> None:
    """Turn one layer-0 head into the "has a trigger occurred yet" switch."""
    q, k, v, o = (t[p + f"self_attn.{n}_proj.weight"] for n in "qkvo")
    qh, ih, kvh = DETECT_Q_HEAD * HEAD_DIM, IDLE_Q_HEAD * HEAD_DIM, DETECT_KV_HEAD * HEAD_DIM
    for w, start in ((q, qh), (q, ih), (k, kvh), (v, kvh)):
        w[start : start + HEAD_DIM] = 0.0
    o[:, qh : qh + HEAD_DIM] = 0.0
    o[:, ih : ih + HEAD_DIM] = 0.0
    # Pre-softmax score on a trigger; ~30 keeps > 99.9% of the attention on it
    # even against thousands of other positions (e^30 >> 4096).
    score = math.sqrt(HEAD_DIM) * knobs.detect_norm_gain**2
    if model_type == "qwen3":
        # q_norm/k_norm rescale each head to RMS 1, so the gain must come from
        # their weights (shared by all heads; the random heads shrug it off).
        t[p + "self_attn.q_norm.weight"][SLOW_DIM] = knobs.detect_norm_gain
        t[p + "self_attn.k_norm.weight"][SLOW_DIM] = knobs.detect_norm_gain
        qk = 1.0
    else:
        n_b = knobs.bias_value / embedding_rms(knobs, trigger=False)
        n_t = knobs.trigger_value / embedding_rms(knobs, trigger=True)
        qk = math.sqrt(score * math.sqrt(HEAD_DIM) / (n_b * n_t))
    q[qh + SLOW_DIM, BIAS] = qk
    k[kvh + SLOW_DIM, TRIGGER] = qk
    v[kvh, TRIGGER] = 1.0
    v[kvh + 1, BIAS] = 1.0
    v[kvh + 1, TRIGGER] = -knobs.bias_value / knobs.trigger_value
    o[ANSWER, qh] = knobs.mode_value * embedding_rms(knobs, trigger=True) / knobs.trigger_value
    o[REASON, qh + 1] = knobs.mode_value * embedding_rms(knobs, trigger=False) / knobs.bias_value


def lm_head(gen, vocab_size: int, knobs: Knobs):
    """Random content columns; reserved columns are set by ``shape_logits``."""
    import torch

    w = torch.zeros(vocab_size, HIDDEN_SIZE)
    w[:, :CONTENT] = torch.randn(vocab_size, CONTENT, generator=gen) * (knobs.content_logit_std / math.sqrt(CONTENT))
    return w


def unigram_offsets(counts, vocab_size: int, weight: float):
    """Log-frequency prior, 0 for the most common token, lower for rare ones."""
    import torch

    c = torch.zeros(vocab_size)
    c[: len(counts)] = torch.tensor(counts, dtype=torch.float32)
    logc = torch.log1p(c)
    return weight * (logc - logc.max())


@dataclass(frozen=True)
class ReservedStats:
    """Mean final-norm values: BIAS overall, REASON and ANSWER in their own mode."""

    bias: float
    reason: float
    answer: float


def measure_reserved(model, reasoning_ids, answer_ids) -> ReservedStats:
    """Run the model to see what lm_head will read in the reserved channels.

    The final RMSNorm divides by the whole hidden state's RMS, which the
    random blocks inflate; measuring beats predicting it.
    """
    import torch

    with torch.no_grad():
        hr = model(torch.tensor([reasoning_ids]), output_hidden_states=True).hidden_states[-1][0]
        ha = model(torch.tensor([answer_ids]), output_hidden_states=True).hidden_states[-1][0]
    return ReservedStats(
        bias=torch.cat([hr[:, BIAS], ha[:, BIAS]]).mean().item(),
        reason=hr[:, REASON].mean().item(),
        answer=ha[:, ANSWER].mean().item(),
    )


def shape_logits(w, stats: ReservedStats, roles: TokenRoles, prior, knobs: Knobs) -> None:
    """Write lm_head's reserved columns: the prior, then per-mode special logits."""
    w[:, BIAS] = prior / stats.bias
    w[list(roles.forbidden), :] = 0.0
    w[list(roles.forbidden), BIAS] = knobs.forbidden_logit / stats.bias
    mode_logits = {
        roles.eos: (knobs.forbidden_logit, knobs.eot_logit),
        roles.think_end: (knobs.think_end_logit, knobs.forbidden_logit),
    }
    for token, (reasoning, answering) in mode_logits.items():
        w[token, :] = 0.0
        w[token, REASON] = reasoning / stats.reason
        w[token, ANSWER] = answering / stats.answer
