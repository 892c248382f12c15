"""Measure how the tiny model samples: stop rate, ``</think>`` rate, lengths.

Used to calibrate ``weights.Knobs`` and by the tests. A hand-written loop
instead of ``generate()``: top-p/temperature semantics match vLLM's and
nothing else (e.g. a library-default top-k) can sneak in. All samples run as
one left-padded batch with a shared KV cache: the step count, not the sample
count, is what costs time on CPU.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

PROMPTS = (
    "What is 17 * 23? Show your work.",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "Solve 3x + 5 = 20.",
    "Give me three ideas for a birthday party.",
    "Translate to French: the cat sleeps on the warm window.",
)


@dataclass(frozen=True)
class SampleStats:
    samples: int
    stop_rate: float
    think_rate: float  # of the stopped samples, those with exactly one </think>
    mean_length: float


def prompt_ids(tokenizer, user_text: str, **template_kwargs) -> list[int]:
    messages = [{"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids


def next_tokens(logits, temperature: float, top_p: float, generator, candidates: int = 256):
    """Greedy at temperature 0, else temperature + nucleus (top-p) sampling."""
    import torch

    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    # The nucleus almost always fits in the top few hundred tokens; topk is
    # ~5x cheaper than a full sort, which stays as the exact fallback.
    top, order = probs.topk(min(candidates, probs.shape[-1]), dim=-1)
    if (top.sum(-1) < top_p).any():
        top, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always the top token).
    top[(top.cumsum(-1) - top) >= top_p] = 0.0
    picked = torch.multinomial(top, 1, generator=generator).squeeze(-1)
    return order.gather(-1, picked[:, None]).squeeze(-1)


def left_padded(prompts: list[list[int]]):
    """Token, attention-mask and position tensors for a left-padded batch."""
    import torch

    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def sample(
    model, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float, seed: int, eos: int
) -> list[list[int]]:
    """``n`` completions of each prompt (prompt-major), each cut after its first ``eos``.

    All rows run as one left-padded batch sharing a KV cache.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, mask, positions = left_padded([p for p in prompts for _ in range(n)])
    out, cache, done = [], None, torch.zeros(len(ids), dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits, cache = forward_cached(model, ids, mask, positions, cache)
            tok = next_tokens(logits[:, -1], temperature, top_p, gen)
            out.append(tok)
            done |= tok == eos
            if done.all():
                break
            ids, positions = tok[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    rows = torch.stack(out, 1).tolist()
    return [cut_at(row, eos) for row in rows]


def forward_cached(model, ids, mask, positions, cache):
    # transformers 5.24 renamed past_key_values to cache; 5.19 (vLLM's venv) has the old name.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    res = model(ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
    return res.logits, getattr(res, name)


def cut_at(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def summarize(completions: list[list[int]], eos: int, think_end: int) -> SampleStats:
    stopped = [c for c in completions if c and c[-1] == eos]
    thought = [c for c in stopped if c.count(think_end) == 1]
    return SampleStats(
        samples=len(completions),
        stop_rate=len(stopped) / len(completions),
        think_rate=len(thought) / max(len(stopped), 1),
        mean_length=sum(map(len, completions)) / len(completions),
    )


def measure(
    model,
    tokenizer,
    *,
    per_prompt: int = 5,
    prompts=PROMPTS,
    max_tokens: int = 256,
    temperature: float = 0.6,
    top_p: float = 0.95,
    seed: int = 0,
    **template_kwargs,
):
    """Sample ``per_prompt`` completions for each prompt; return all of them and their stats."""
    eos = tokenizer.eos_token_id
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    ids = [prompt_ids(tokenizer, text, **template_kwargs) for text in prompts]
    completions = sample(model, ids, per_prompt, max_tokens, temperature, top_p, seed, eos)
    return completions, summarize(completions, eos, think_end)
