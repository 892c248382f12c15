"""The fake tokenizer and the deterministic model: a prompt's digest fixes its completion."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from array import array
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any, Sequence

from .config import FakeConfig

EOS, IM_START, THINK_START, THINK_END = 2, 1, 3, 4
ROLE_IDS = {"system": 5, "user": 6, "assistant": 7, "tool": 8}
FIRST_WORD = 16
VOCAB_SIZE = 4096
_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "system",
    "user",
    "assistant",
    "tool",
    "\n",
    ".",
    ",",
    "?",
    "!",
    ":",
    "\n\n",
]
_POOL_SIZE = 1 << 17


@cache
def vocabulary() -> list[str]:
    """The fake tokenizer: 16 special/punctuation pieces, then 4080 two-syllable words."""
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = [
        ("" if k % 7 == 0 else " ") + syllables[k % 80] + syllables[k // 80] for k in range(VOCAB_SIZE - FIRST_WORD)
    ]
    return _SPECIAL + words


@cache
def _pool() -> tuple[list[int], str, list[int]]:
    """A fixed random token stream; a completion is a slice of it (C-speed, deterministic)."""
    vocab = vocabulary()
    raw = array("H", random.Random(1234).randbytes(2 * _POOL_SIZE))
    ids = [10 + (x >> 4) % 6 if x & 15 == 0 else FIRST_WORD + (x >> 4) % (VOCAB_SIZE - FIRST_WORD) for x in raw]
    pieces = [vocab[i] for i in ids]
    return ids, "".join(pieces), [0, *itertools.accumulate(map(len, pieces))]


def _pool_slice(offset: int, n: int) -> tuple[list[int], str]:
    ids, text, starts = _pool()
    if n > _POOL_SIZE:  # longer than the pool: repeat it
        reps = -(-n // _POOL_SIZE)
        return (ids * reps)[:n], decode((ids * reps)[:n])
    offset %= _POOL_SIZE - n + 1
    return ids[offset : offset + n], text[starts[offset] : starts[offset + n]]


def decode(ids: Sequence[int]) -> str:
    vocab = vocabulary()
    return "".join(vocab[i] for i in ids)


def encode_text(text: str) -> list[int]:
    """One fake token per 4 UTF-8 bytes."""
    raw = text.encode()
    raw += b"\0" * (-len(raw) % 4)
    return [FIRST_WORD + x % (VOCAB_SIZE - FIRST_WORD) for x in array("I", raw)]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass(frozen=True)
class Prompt:
    """What the server derives from a request's messages."""

    digest: bytes  # 32 bytes: the prompt's identity and its randomness
    texts: tuple[tuple[str, str], ...]  # (role, text) per message
    last_user: str

    @property
    def key(self) -> str:
        """The stats key: the first 40 characters of the last user message."""
        return self.last_user[:40]

    @property
    def num_chars(self) -> int:
        return sum(len(t) for _, t in self.texts)

    @cached_property
    def token_ids(self) -> list[int]:
        """A chat-template-like rendering: <|im_start|>role text<|im_end|>\\n ... <|im_start|>assistant."""
        ids: list[int] = []
        for role, text in self.texts:
            ids += [IM_START, ROLE_IDS.get(role, ROLE_IDS["user"]), 9, *encode_text(text), EOS, 9]
        return ids + [IM_START, ROLE_IDS["assistant"], 9]


def make_prompt(messages: list[dict], seed: int = 0) -> Prompt:
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.blake2b(f"{seed}:{canonical}".encode(), digest_size=32).digest()
    texts = tuple((str(m.get("role", "")), _content_text(m.get("content"))) for m in messages)
    last_user = next((t for r, t in reversed(texts) if r == "user"), "")
    return Prompt(digest, texts, last_user)


def _uniforms(digest: bytes) -> list[float]:
    """Four uniforms in (0, 1) from a 32-byte digest."""
    return [(int.from_bytes(digest[i : i + 8], "little") + 0.5) / 2**64 for i in range(0, 32, 8)]


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    reasoning: str | None
    content: str | None
    finish_reason: str  # "stop" | "length"
    reasoning_tokens: int


def natural_length(cfg: FakeConfig, prompt: Prompt, max_tokens: int) -> int:
    """The completion's length before the max_tokens cut: lognormal, heavy-tailed, at least 4."""
    u1, u2, _, _ = _uniforms(prompt.digest)
    median = cfg.median_tokens or max(max_tokens / 4, 1)
    z = math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)
    return max(4, round(median * math.exp(cfg.length_sigma * z)))


def make_completion(cfg: FakeConfig, prompt: Prompt, max_tokens: int) -> Completion:
    """What vLLM with a reasoning parser sends: reasoning ids, </think>, answer ids, <|im_end|>, cut at max_tokens."""
    total = natural_length(cfg, prompt, max_tokens)
    _, _, u3, u4 = _uniforms(prompt.digest)
    offset = int(u4 * _POOL_SIZE)
    n_reason = max(1, int(total * (0.5 + 0.3 * u3))) if cfg.reasoning else 0
    n_answer = max(1, total - n_reason - (2 if cfg.reasoning else 1))
    natural = n_reason + n_answer + (2 if cfg.reasoning else 1)
    kept = min(max_tokens, natural)
    finish = "stop" if kept == natural else "length"
    if not cfg.reasoning:
        ids, text = _pool_slice(offset, min(n_answer, kept))
        return Completion(ids + [EOS] * (kept - len(ids)), None, text or None, finish, 0)
    reason_ids, reason_text = _pool_slice(offset, min(n_reason, kept))
    if kept <= n_reason:  # cut inside the reasoning: no </think>, no content (vLLM's qwen3 parser)
        return Completion(reason_ids, reason_text, None, finish, len(reason_ids))
    answer_ids, answer_text = _pool_slice(offset + 7919, min(n_answer, kept - n_reason - 1))
    ids = reason_ids + [THINK_END] + answer_ids + [EOS] * (kept - n_reason - 1 - len(answer_ids))
    return Completion(ids, reason_text, answer_text or None, finish, len(reason_ids))


def completion_for(cfg: FakeConfig, messages: list[dict], max_tokens: int) -> tuple[list[int], Completion]:
    """(prompt_token_ids, completion) exactly as the server would answer: for checking what a client stored."""
    prompt = make_prompt(messages, cfg.seed)
    return prompt.token_ids, make_completion(cfg, prompt, max_tokens)


def work_seconds(cfg: FakeConfig, completion_tokens: int) -> float:
    """Slot time one generation costs: prefill + decode."""
    return cfg.ttft_s + (completion_tokens / cfg.tokens_per_s if cfg.tokens_per_s else 0.0)


def ideal_seconds(cfg: FakeConfig, prompts: Sequence[list[dict]], max_tokens: int) -> float:
    """Shortest possible wall time for these prompts (one attempt each): work / slots, or the longest one."""
    works = [work_seconds(cfg, len(completion_for(cfg, m, max_tokens)[1].token_ids)) for m in prompts]
    if not works:
        return 0.0
    return max(max(works), sum(works) / cfg.slots) if cfg.slots else max(works)


def ideal_throughput(cfg: FakeConfig, prompts: Sequence[list[dict]], max_tokens: int) -> float:
    """Best achievable requests/s for these prompts (inf when the server has no latency)."""
    seconds = ideal_seconds(cfg, prompts, max_tokens)
    return len(prompts) / seconds if seconds > 0 else math.inf
