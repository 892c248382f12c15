"""A fault-injecting fake of vLLM's OpenAI chat server — a test tool, never part of the product.

Design choices:
- **Wire format copied from vLLM 0.32**, not from the OpenAI spec: the response is what
  `ChatCompletionResponse.model_dump()` sends (every field present, unset ones null), with the
  vLLM extras `prompt_token_ids` (top level), choice `token_ids`, `stop_reason`,
  `message.reasoning` and `usage.completion_tokens_details.reasoning_tokens`. Errors use vLLM's
  `{"error": {"message", "type", "param", "code"}}`; a bad API key gets the auth middleware's
  bare `{"error": "Unauthorized"}`; unknown routes get FastAPI's `{"detail": "Not Found"}`.
- **Deterministic per prompt.** A BLAKE2 digest of the messages (canonical JSON) fixes the
  completion length (lognormal, median `max_tokens / 4` unless `median_tokens` is set, cut at
  `max_tokens` -> finish "length") and where its tokens come from. Token ids index a fake 4096-entry
  vocabulary, so ids and text agree (reasoning ids, `</think>`, answer ids, `<|im_end|>`), and
  `completion_for()` reproduces any response offline for checks on what a client stored.
- **Stdlib only, hand-written asyncio HTTP/1.1.** Measured on the 2-core box with the same fake model
  behind both: ~100 us of server CPU per request against ~260 us for Starlette + uvicorn(h11), and it
  can do what an ASGI app cannot: drop a connection with a TCP RST, or hold one open unanswered.
  The no-latency path answers inside `data_received` without creating a task.
- **Not vLLM beyond the wire**: chat is n=1 only, no streaming (400), sampling parameters ignored.
  `/v1/completions` takes a string prompt with `n`, `stop` and `seed` (the self-written prompts'
  route): choice k answers `completion_script[(seed + k) % len]` or a stream slice, cut at a stop string
  or at max_tokens ("length"). Like vLLM 0.32, chat's max_tokens above max_model_len is a 400 and
  otherwise clamped to the context left.
- **Faults never hold a generation slot**, so benchmark ideal times are `busy_slot_seconds / slots`
  whatever the fault mix. Rule faults are tracked per prompt (full digest, not the 40-char stats
  key); several rules matching one prompt fire in order (e.g. a 429 once, then a 500 once).
- **Two ways to run**: a thread of the test process (fast start, unit tests) or its own process
  (benchmarks, so the server does not share the client's GIL); both bind port 0 and report the
  port back, so there is no free-port race.

Use:
    cfg = FakeConfig(rules=[FaultRule("flaky", "status", times=2, status=503)], slots=64, tokens_per_s=500)
    with run_fake_server(cfg, in_thread=True) as srv:          # in_thread=False for benchmarks
        client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=5)
        ...
        srv.stats()["attempts"]        # {first 40 chars of the last user message: attempts}
Random faults: `fault_rate` with `fault_mix` keys "hang", "reset", "slow", "malformed", "5xx" (one
of 500/502/503/504) or any status code as a string ("429"). GET /stats?attempts=0 skips the
per-prompt table; POST /stats/reset also forgets the per-prompt fault state.
Standalone: python tests/fake_openai.py --port 8000 --config '{"slots": 8, "tokens_per_s": 100}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import http.client
import itertools
import json
import math
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from functools import cache, cached_property
from http import HTTPStatus
from typing import Any, Awaitable, Iterator, Sequence

FAULT_KINDS = ("hang", "status", "reset", "slow", "malformed")
MIX_KINDS = ("hang", "reset", "slow", "malformed", "5xx")  # plus any status code written as digits: "429"
SERVER_ERRORS = (500, 502, 503, 504)
MALFORMED_BODY = '{"id":"chatcmpl-broken","object":"chat.completion","choices":[{"index":0,"mess'


# --------------------------------------------------------------------------- configuration


@dataclass
class FaultRule:
    """Fail requests whose last user message contains `match`: the first `times` attempts (None: all)."""

    match: str
    kind: str  # hang | status | reset | slow | malformed
    times: int | None = 1
    status: int | None = None  # kind "status": the HTTP code to answer
    retry_after: float | None = None  # kind "status": a Retry-After header, in seconds
    delay_s: float = 0.0  # kind "slow": wait this long, then answer normally
    body: str | None = None  # kind "malformed": the 200 body (default: truncated JSON)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FaultRule.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.kind == "status" and not (self.status and 400 <= self.status <= 599):
            raise ValueError(f"FaultRule(kind='status') needs status in 400..599, got {self.status!r}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"FaultRule.times must be >= 0 or None, got {self.times}")


@dataclass
class FakeConfig:
    """Everything the fake server does; JSON-serialisable so a subprocess can take it on the command line."""

    model: str = "fake-target"
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    slots: int | None = None  # concurrent generations (vLLM's max_num_seqs); None: unbounded
    tokens_per_s: float | None = None  # decode speed per slot; None or 0: no decode time
    ttft_s: float = 0.0  # fixed prefill time per request, spent holding a slot
    rules: list[FaultRule] = field(default_factory=list)
    fault_rate: float = 0.0  # random faults: probability per attempt, keyed on (seed, prompt, attempt)
    fault_mix: dict[str, float] = field(default_factory=lambda: {"hang": 0.25, "429": 0.25, "5xx": 0.25, "reset": 0.25})
    hang_s: float = 3600.0  # a hang closes the connection (no response) after this long
    slow_s: float = 1.0  # random "slow" faults: extra delay before answering
    fault_retry_after: float | None = None  # Retry-After on random 429/503 faults
    max_prompt_chars: int = 100_000  # longer prompts get vLLM's 400 "maximum context length"
    max_model_len: int = 32_768  # reported by /v1/models and in the context-length message
    median_tokens: int | None = None  # median natural completion length; None: max_tokens / 4
    length_sigma: float = 1.0  # lognormal sigma of the completion length (heavy tail)
    seed: int = 0
    reasoning: bool = True  # as if vLLM ran with a reasoning parser (message.reasoning filled)
    # /v1/completions: choice k of a request with seed s answers completion_script[(s + k) % len] (vLLM seeds
    # its n samples s + k); None: a slice of the fake token stream, as long as a chat answer would be.
    completion_script: list[str] | None = None

    def __post_init__(self) -> None:
        self.rules = [r if isinstance(r, FaultRule) else FaultRule(**r) for r in self.rules]
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1 or None, got {self.slots}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate}")
        for kind, weight in self.fault_mix.items():
            if kind not in MIX_KINDS and not (kind.isdigit() and 400 <= int(kind) <= 599):
                raise ValueError(f"fault_mix key {kind!r}: use {MIX_KINDS} or a status code such as '429'")
            if weight < 0:
                raise ValueError(f"fault_mix weight for {kind!r} is negative")
        if self.fault_rate > 0 and sum(self.fault_mix.values()) <= 0:
            raise ValueError("fault_rate > 0 needs a fault_mix with positive weight")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FakeConfig:
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- fake tokenizer

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


# --------------------------------------------------------------------------- the deterministic model


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


# --------------------------------------------------------------------------- vLLM JSON bodies


def _json(obj: Any) -> bytes:
    # What Starlette's JSONResponse writes.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def chat_body(cfg: FakeConfig, request_id: str, prompt_ids: list[int], comp: Completion, return_ids: bool) -> dict:
    """`ChatCompletionResponse.model_dump()` of vLLM 0.32 (chat_completion/protocol.py, serving.py)."""
    n_prompt, n_out = len(prompt_ids), len(comp.token_ids)
    message = {
        "role": "assistant",
        "content": comp.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": comp.reasoning,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": comp.finish_reason,
        "stop_reason": None,
        "token_ids": comp.token_ids if return_ids else None,
        "routed_experts": None,
    }
    usage = {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
        "completion_tokens_details": {"reasoning_tokens": comp.reasoning_tokens} if cfg.reasoning else None,
    }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if return_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_choice(cfg: FakeConfig, request: dict, prompt: Prompt, k: int) -> tuple[str, str, str | None, list[int]]:
    """(text, finish_reason, stop_reason, token_ids) of choice ``k``: the script entry or a stream slice,
    cut at the first stop string (not included, as vLLM does), else at max_tokens (one token per 4 bytes)."""
    max_tokens, seed = request.get("max_tokens") or 16, request.get("seed")
    if cfg.completion_script:
        base = seed if seed is not None else int.from_bytes(prompt.digest[:4], "little")
        text = cfg.completion_script[(base + k) % len(cfg.completion_script)]
    else:
        sub = make_prompt(
            [{"role": "user", "content": prompt.last_user}, {"role": "choice", "content": f"{seed}:{k}"}], cfg.seed
        )
        text = _pool_slice(int(_uniforms(sub.digest)[3] * _POOL_SIZE), natural_length(cfg, sub, max_tokens))[1]
    stops = request.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    hits = sorted((text.find(s), s) for s in stops if s and s in text)
    if hits:
        text, finish, stop_reason = text[: hits[0][0]], "stop", hits[0][1]
    elif len(encode_text(text)) > max_tokens:
        text, finish, stop_reason = text.encode()[: 4 * max_tokens].decode(errors="ignore"), "length", None
    else:
        finish, stop_reason = "stop", None
    return text, finish, stop_reason, encode_text(text)


def completion_body(cfg: FakeConfig, prompt: Prompt, choices: list[tuple], return_ids: bool) -> dict:
    """`CompletionResponse.model_dump()` of vLLM 0.32 (completion/protocol.py)."""
    prompt_ids = encode_text(prompt.last_user)
    out = [
        {
            "index": k,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop,
            "token_ids": ids if return_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if return_ids and k == 0 else None,
            "routed_experts": None,
        }
        for k, (text, finish, stop, ids) in enumerate(choices)
    ]
    n_out = sum(len(c[3]) for c in choices)
    usage = {
        "prompt_tokens": len(prompt_ids),
        "total_tokens": len(prompt_ids) + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": None,
    }
    return {
        "id": f"cmpl-{os.urandom(8).hex()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": cfg.model,
        "choices": out,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """vLLM's ErrorResponse (serve/engine/protocol.py); other codes typed by their phrase, as its HTTP handler does."""
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def too_long_body(cfg: FakeConfig, n_chars: int) -> dict:
    """vLLM's renderers/params.py `_text_len_check` message, raised as a VLLMValidationError."""
    max_tokens = cfg.max_prompt_chars // 4
    message = (
        f"This model's maximum context length is {cfg.max_model_len} tokens. However, your prompt contains "
        f"{n_chars} characters (more than {cfg.max_prompt_chars} characters, which is the upper bound for "
        f"{max_tokens} input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={n_chars})"
    )
    return error_body(400, message, "input_text")


def models_body(cfg: FakeConfig) -> dict:
    now = int(time.time())
    permission = {
        "id": f"modelperm-{os.urandom(8).hex()}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": cfg.model,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


# --------------------------------------------------------------------------- replies and state


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = "application/json"


RESET = "reset"  # abort the connection with a TCP RST, no response
CLOSE = "close"  # close the connection (FIN), no response


def _json_reply(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, _json(obj), headers)


@dataclass
class Stats:
    requests_total: int = 0
    completed: int = 0
    faults: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    attempts: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    completion_seeds: Counter = field(default_factory=Counter)  # /v1/completions: {seed: attempts}
    in_flight: int = 0
    max_in_flight: int = 0
    generating: int = 0
    max_generating: int = 0
    busy_slot_seconds: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    def snapshot(self, with_attempts: bool = True) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "started"}
        data = {k: dict(v) if isinstance(v, Counter) else v for k, v in data.items()}
        data["uptime_s"] = time.monotonic() - self.started
        if not with_attempts:
            del data["attempts"]
        return data


@dataclass(frozen=True)
class Fault:
    kind: str  # hang | status | reset | slow | malformed
    status: int | None = None
    retry_after: float | None = None
    delay_s: float = 0.0
    body: str | None = None

    @property
    def name(self) -> str:
        return str(self.status) if self.kind == "status" else self.kind


def _mix_fault(cfg: FakeConfig, kind: str, u: float) -> Fault:
    if kind == "5xx":
        kind = str(SERVER_ERRORS[int(u * len(SERVER_ERRORS)) % len(SERVER_ERRORS)])
    if kind.isdigit():
        retry = cfg.fault_retry_after if kind in ("429", "503") else None
        return Fault("status", int(kind), retry)
    return Fault(kind, delay_s=cfg.slow_s)


class FakeApp:
    """Routing, auth, fault decisions and the latency model; knows nothing of sockets."""

    def __init__(self, cfg: FakeConfig):
        self.cfg = cfg
        self.stats = Stats()
        self._attempts: dict[bytes, int] = {}
        self._fired: Counter = Counter()  # (rule index, prompt digest) -> times fired
        self._slots = asyncio.Semaphore(cfg.slots) if cfg.slots else None
        self._mix = sorted(cfg.fault_mix.items())
        self._mix_total = sum(w for _, w in self._mix)
        self._auth = f"Bearer {cfg.api_key}" if cfg.api_key else None

    def reset(self) -> None:
        """Forget stats and per-prompt fault state (requests in flight finish normally)."""
        in_flight, generating = self.stats.in_flight, self.stats.generating
        self.stats = Stats(in_flight=in_flight, generating=generating)
        self._attempts.clear()
        self._fired.clear()

    def handle(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Reply | str | Awaitable:
        path, _, query = target.partition("?")
        if path == "/v1/chat/completions" and method == "POST":
            return self.chat(headers, body)
        if path == "/v1/completions" and method == "POST":
            return self.completions(headers, body)
        if path == "/health" and method == "GET":
            return Reply(200, content_type="")
        if path.startswith("/v1") and self._auth and headers.get("authorization") != self._auth:
            return _json_reply(401, {"error": "Unauthorized"})
        if path == "/v1/models" and method == "GET":
            return _json_reply(200, models_body(self.cfg))
        if path == "/stats" and method == "GET":
            return _json_reply(200, self.stats.snapshot(with_attempts="attempts=0" not in query))
        if path == "/stats/reset" and method == "POST":
            self.reset()
            return _json_reply(200, {"ok": True})
        if path in ("/v1/chat/completions", "/v1/completions", "/health", "/v1/models", "/stats", "/stats/reset"):
            return _json_reply(405, {"detail": "Method Not Allowed"})
        return _json_reply(404, {"detail": "Not Found"})

    # -- chat completions

    def _authorized_json(self, headers: dict[str, str], body: bytes) -> Reply | object:
        """The request body decoded, or the reply vLLM gives a bad key or malformed JSON."""
        if self._auth and headers.get("authorization") != self._auth:
            self.stats.rejected["unauthorized"] += 1
            return _json_reply(401, {"error": "Unauthorized"})
        try:
            return json.loads(body)
        except ValueError as exc:
            return self._bad_request(f"JSON decode error: {exc}", "invalid_json")

    def _parse_chat(self, headers: dict[str, str], body: bytes) -> Reply | tuple[dict, int | None]:
        request = self._authorized_json(headers, body)
        if isinstance(request, Reply):
            return request
        messages = request.get("messages") if isinstance(request, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            message = "1 validation error: messages: Field required (a non-empty list)"
            return self._bad_request(message, "invalid_request")
        if request.get("model") not in (None, self.cfg.model):
            self.stats.rejected["unknown_model"] += 1
            message = f"The model `{request['model']}` does not exist. Valid aliases: {self.cfg.model}."
            return _json_reply(404, error_body(404, message, "model"))
        if request.get("stream"):
            return self._bad_request("stream=true is not supported by the fake server", "stream")
        param = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = request.get(param)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return self._bad_request(f"{param} must be at least 1, got {max_tokens}.", "invalid_request")
        if max_tokens is not None and max_tokens > self.cfg.max_model_len:  # renderers/params.py __post_init__
            self.stats.rejected["max_tokens_too_large"] += 1
            message = (
                f"{param}={max_tokens} cannot be greater than max_model_len={self.cfg.max_model_len}. "
                f"Please request fewer output tokens. (parameter={param}, value={max_tokens})"
            )
            return _json_reply(400, error_body(400, message, param))
        return request, max_tokens

    def _bad_request(self, message: str, reason: str) -> Reply:
        self.stats.rejected[reason] += 1
        return _json_reply(400, error_body(400, message))

    def chat(self, headers: dict[str, str], body: bytes) -> Reply | str | Awaitable:
        self.stats.requests_total += 1
        parsed = self._parse_chat(headers, body)
        if isinstance(parsed, Reply):
            return parsed
        request, max_tokens = parsed
        prompt = make_prompt(request["messages"], self.cfg.seed)
        attempt = self._attempts[prompt.digest] = self._attempts.get(prompt.digest, 0) + 1
        self.stats.attempts[prompt.key] += 1
        if prompt.num_chars > self.cfg.max_prompt_chars:
            self.stats.rejected["too_long"] += 1
            return _json_reply(400, too_long_body(self.cfg, prompt.num_chars))
        room = self.cfg.max_model_len - len(prompt.token_ids)  # vLLM's get_max_tokens(): clamp to the context left
        max_tokens = max(1, room if max_tokens is None else min(max_tokens, room))
        fault = self._rule_fault(prompt) or self._random_fault(prompt, attempt)
        if fault is not None:
            self.stats.faults[fault.name] += 1
            if fault.kind != "slow":
                return self._fault_reply(fault)
        request_id = "chatcmpl-" + (headers.get("x-request-id") or os.urandom(8).hex())
        comp = make_completion(self.cfg, prompt, max_tokens)
        answer = (prompt, comp, bool(request.get("return_token_ids")), request_id)
        if fault is None and self._slots is None and not self.cfg.ttft_s and not self.cfg.tokens_per_s:
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight + 1)
            self.stats.max_generating = max(self.stats.max_generating, self.stats.generating + 1)
            return self._answer(*answer)
        return self._answer_later(answer, fault.delay_s if fault else 0.0)

    # -- text completions (what self-written prompts use): n choices, stop strings, seeds

    def _parse_completion(self, headers: dict[str, str], body: bytes) -> Reply | dict:
        request = self._authorized_json(headers, body)
        if isinstance(request, Reply):
            return request
        if not isinstance(request, dict) or not isinstance(request.get("prompt"), str):
            return self._bad_request(
                "1 validation error: prompt: a string is required by the fake server", "invalid_request"
            )
        if request.get("model") not in (None, self.cfg.model):
            self.stats.rejected["unknown_model"] += 1
            return _json_reply(
                404,
                error_body(
                    404, f"The model `{request['model']}` does not exist. Valid aliases: {self.cfg.model}.", "model"
                ),
            )
        if request.get("stream"):
            return self._bad_request("stream=true is not supported by the fake server", "stream")
        n, max_tokens = request.get("n") or 1, request.get("max_tokens") or 16  # vLLM's CompletionRequest default
        if not isinstance(n, int) or n < 1 or not isinstance(max_tokens, int) or max_tokens < 1:
            return self._bad_request(
                f"n and max_tokens must be positive integers, got {n!r} and {max_tokens!r}", "invalid_request"
            )
        return request

    def completions(self, headers: dict[str, str], body: bytes) -> Reply | str | Awaitable:
        self.stats.requests_total += 1
        request = self._parse_completion(headers, body)
        if isinstance(request, Reply):
            return request
        seed = request.get("seed")
        # Fault state per request (prompt + seed): self-written prompts send one prefix with many seeds.
        tag = f"{seed}" if seed is not None else f"unseeded-{self.stats.requests_total}"
        digest = hashlib.blake2b(f"{self.cfg.seed}:{tag}:{request['prompt']}".encode(), digest_size=32).digest()
        prompt = Prompt(digest, (("user", request["prompt"]),), request["prompt"])
        self._attempts[digest] = self._attempts.get(digest, 0) + 1
        self.stats.attempts[prompt.key] += 1
        self.stats.completion_seeds[str(seed)] += 1
        fault = self._rule_fault(prompt) or self._random_fault(prompt, self._attempts[digest])
        if fault is not None:
            self.stats.faults[fault.name] += 1
            if fault.kind != "slow":
                return self._fault_reply(fault)
        choices = [completion_choice(self.cfg, request, prompt, k) for k in range(request.get("n") or 1)]
        reply = _json_reply(200, completion_body(self.cfg, prompt, choices, bool(request.get("return_token_ids"))))
        self.stats.completed += 1
        for c in choices:
            self.stats.finish_reasons[c[1]] += 1
            self.stats.completion_tokens += len(c[3])
        work = max(work_seconds(self.cfg, len(c[3])) for c in choices)  # n samples decode side by side
        if fault is None and not work and self._slots is None:
            return reply
        return self._later(reply, work, fault.delay_s if fault else 0.0)

    async def _later(self, reply: Reply, work: float, delay_s: float) -> Reply:
        self._enter()
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            async with self._slots or contextlib.nullcontext():
                await self._generate(work)
            return reply
        finally:
            self.stats.in_flight -= 1

    def _rule_fault(self, prompt: Prompt) -> Fault | None:
        for index, rule in enumerate(self.cfg.rules):
            if rule.match in prompt.last_user:
                fired = self._fired[index, prompt.digest]
                if rule.times is None or fired < rule.times:
                    self._fired[index, prompt.digest] = fired + 1
                    return Fault(rule.kind, rule.status, rule.retry_after, rule.delay_s, rule.body)
        return None

    def _random_fault(self, prompt: Prompt, attempt: int) -> Fault | None:
        if self.cfg.fault_rate <= 0:
            return None
        key = prompt.digest + f":{self.cfg.seed}:{attempt}:fault".encode()
        u_rate, u_kind, u_code, _ = _uniforms(hashlib.blake2b(key, digest_size=32).digest())
        if u_rate >= self.cfg.fault_rate:
            return None
        target = u_kind * self._mix_total
        for kind, weight in self._mix:
            if target < weight:
                return _mix_fault(self.cfg, kind, u_code)
            target -= weight
        return _mix_fault(self.cfg, self._mix[-1][0], u_code)

    def _fault_reply(self, fault: Fault) -> Reply | str | Awaitable:
        if fault.kind == "reset":
            return RESET
        if fault.kind == "hang":
            return self._hang()
        if fault.kind == "malformed":
            return Reply(200, (fault.body if fault.body is not None else MALFORMED_BODY).encode())
        headers = (("retry-after", f"{fault.retry_after:g}"),) if fault.retry_after is not None else ()
        message = f"Injected fault: HTTP {fault.status}."
        return _json_reply(fault.status, error_body(fault.status, message), headers)

    async def _hang(self) -> str:
        self._enter()
        try:
            await asyncio.sleep(self.cfg.hang_s)  # cancelled when the client gives up and disconnects
            return CLOSE
        finally:
            self.stats.in_flight -= 1

    def _enter(self) -> None:
        self.stats.in_flight += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)

    def _answer(self, prompt: Prompt, comp: Completion, return_ids: bool, request_id: str) -> Reply:
        prompt_ids = prompt.token_ids
        self.stats.completed += 1
        self.stats.finish_reasons[comp.finish_reason] += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.completion_tokens += len(comp.token_ids)
        return _json_reply(200, chat_body(self.cfg, request_id, prompt_ids, comp, return_ids))

    async def _answer_later(self, answer: tuple, delay_s: float) -> Reply:
        self._enter()
        try:
            if delay_s:
                await asyncio.sleep(delay_s)
            async with self._slots or contextlib.nullcontext():
                await self._generate(work_seconds(self.cfg, len(answer[1].token_ids)))
            return self._answer(*answer)
        finally:
            self.stats.in_flight -= 1

    async def _generate(self, work: float) -> None:
        # Always self.stats, never a local: a reset carries the live counters over to the new Stats.
        self.stats.generating += 1
        self.stats.max_generating = max(self.stats.max_generating, self.stats.generating)
        try:
            if work > 0:
                await asyncio.sleep(work)
            self.stats.busy_slot_seconds += work
        finally:
            self.stats.generating -= 1


# --------------------------------------------------------------------------- HTTP/1.1 over asyncio

_MAX_HEAD = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024


def _encode_reply(reply: Reply, keep_alive: bool) -> bytes:
    phrase = HTTPStatus(reply.status).phrase
    lines = [f"HTTP/1.1 {reply.status} {phrase}", f"content-length: {len(reply.body)}"]
    if reply.content_type:
        lines.append(f"content-type: {reply.content_type}")
    lines += [f"{k}: {v}" for k, v in reply.headers]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + reply.body


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests in order, answers inline or through one task at a time."""

    def __init__(self, app: FakeApp, connections: set):
        self.app = app
        self.connections = connections
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.connections.discard(self)
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._process()

    def _process(self) -> None:
        while not self.closed and self.task is None:
            request = self._next_request()
            if request is None:
                return
            method, target, headers, body, keep_alive = request
            try:
                result = self.app.handle(method, target, headers, body)
            except Exception as exc:  # a bug here must show up as a 500, not a dead connection
                result = _json_reply(500, error_body(500, f"fake server bug: {exc!r}"))
            if isinstance(result, (Reply, str)):
                self._finish(result, keep_alive)
            else:
                self.task = asyncio.ensure_future(result)
                self.task.add_done_callback(lambda t, k=keep_alive: self._task_done(t, k))

    def _task_done(self, task: asyncio.Task, keep_alive: bool) -> None:
        self.task = None
        if task.cancelled() or self.closed:
            return
        exc = task.exception()
        if exc is not None:
            self._finish(_json_reply(500, error_body(500, f"fake server bug: {exc!r}")), False)
        else:
            self._finish(task.result(), keep_alive)
        self._process()

    def _finish(self, result: Reply | str, keep_alive: bool) -> None:
        if result == RESET:
            self.abort()
        elif result == CLOSE:
            self.close()
        else:
            self.transport.write(_encode_reply(result, keep_alive))
            if not keep_alive:
                self.close()

    def _next_request(self) -> tuple[str, str, dict[str, str], bytes, bool] | None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                self._finish(_json_reply(431, {"detail": "Request Header Fields Too Large"}), False)
            return None
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            self._finish(_json_reply(400, {"detail": "Bad Request"}), False)
            return None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            self._finish(_json_reply(411, {"detail": "Length Required"}), False)
            return None
        length = headers.get("content-length") or "0"
        length = int(length) if length.isdigit() else _MAX_BODY + 1
        if length > _MAX_BODY:
            self._finish(_json_reply(413, {"detail": "Request Entity Too Large"}), False)
            return None
        if len(self.buffer) < end + 4 + length:
            return None
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
        return method, target, headers, body, keep_alive

    def close(self) -> None:
        self.closed = True
        self.transport.close()

    def abort(self) -> None:
        """Drop the connection with a TCP RST (SO_LINGER 0), the way a crashed server looks."""
        self.closed = True
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


async def serve(cfg: FakeConfig, host: str, port: int, stop: asyncio.Future, on_ready=None) -> None:
    """Serve until `stop` resolves; then drop every connection."""
    app = FakeApp(cfg)
    connections: set[HttpConnection] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: HttpConnection(app, connections), host, port, backlog=4096, reuse_address=True
    )
    if on_ready is not None:
        on_ready(server.sockets[0].getsockname()[1])
    try:
        await stop
    finally:
        server.close()
        for conn in list(connections):
            conn.abort()
        await server.wait_closed()
        await asyncio.sleep(0)  # let cancelled tasks unwind


# --------------------------------------------------------------------------- running it from tests


def _http(url_root: str, method: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    host, port = url_root.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_healthy(url: str, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"fake server exited with code {proc.returncode} before answering /health")
        try:
            if _http(url, "GET", "/health", timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake server at {url} not healthy after {timeout_s} s")
        time.sleep(0.02)


@dataclass
class FakeServer:
    """What `run_fake_server` yields."""

    config: FakeConfig
    port: int
    host: str = "127.0.0.1"
    pid: int | None = None  # the server process (subprocess mode)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stats(self, attempts: bool = True) -> dict:
        status, body = _http(self.url, "GET", "/stats" if attempts else "/stats?attempts=0")
        if status != 200:
            raise RuntimeError(f"GET /stats answered {status}")
        return json.loads(body)

    def reset_stats(self) -> None:
        status, _ = _http(self.url, "POST", "/stats/reset")
        if status != 200:
            raise RuntimeError(f"POST /stats/reset answered {status}")


@contextlib.contextmanager
def _in_thread(cfg: FakeConfig, host: str, port: int, startup_timeout_s: float) -> Iterator[FakeServer]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        async def run() -> None:
            box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
            await serve(cfg, host, port, box["stop"], on_ready=lambda p: (box.update(port=p), ready.set()))

        try:
            asyncio.run(run())
        except BaseException as exc:  # surfaced to the caller below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=main, name="fake-openai", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout_s) or "error" in box:
        raise RuntimeError(f"fake server thread failed to start: {box.get('error')!r}")
    server = FakeServer(cfg, box["port"], host)
    try:
        wait_healthy(server.url, startup_timeout_s)
        yield server
    finally:
        box["loop"].call_soon_threadsafe(lambda: box["stop"].done() or box["stop"].set_result(None))
        thread.join(10)


def _read_port(proc: subprocess.Popen, timeout_s: float) -> int:
    """The child prints `LISTENING <port>` once bound."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError(f"fake server subprocess did not report its port in {timeout_s} s")
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("LISTENING "):
        raise RuntimeError(f"fake server subprocess failed to start (exit {proc.poll()}): {line!r}")
    return int(line.split()[1])


def _stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL to its process group (its own session) after the grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet, so the group id is still ours
            proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


@contextlib.contextmanager
def _in_process(
    cfg: FakeConfig, host: str, port: int, startup_timeout_s: float, grace_s: float
) -> Iterator[FakeServer]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--config",
        cfg.to_json(),
        "--host",
        host,
        "--port",
        str(port),
        "--parent-pid",
        str(os.getpid()),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        server = FakeServer(cfg, _read_port(proc, startup_timeout_s), host, pid=proc.pid)
        wait_healthy(server.url, startup_timeout_s, proc)
        yield server
    finally:
        _stop_process(proc, grace_s)


@contextlib.contextmanager
def run_fake_server(
    config: FakeConfig | None = None,
    port: int = 0,
    *,
    in_thread: bool = True,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 20.0,
    grace_s: float = 5.0,
) -> Iterator[FakeServer]:
    """Start the fake server (port 0: a free one), wait for /health, yield it, stop it on exit.

    in_thread=True: a thread of this process (unit tests). in_thread=False: its own process, so a
    benchmark measures the client rather than a shared GIL.
    """
    cfg = config or FakeConfig()
    if in_thread:
        with _in_thread(cfg, host, port, startup_timeout_s) as server:
            yield server
    else:
        with _in_process(cfg, host, port, startup_timeout_s, grace_s) as server:
            yield server


# --------------------------------------------------------------------------- command line


def _watch_parent(parent_pid: int, stop: asyncio.Future) -> None:
    """Stop when the process that started us is gone, so a crashed test run leaves no server behind."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if os.getppid() != parent_pid and not stop.done():
            stop.set_result(None)
        elif not stop.done():
            loop.call_later(1.0, check)

    loop.call_later(1.0, check)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fault-injecting fake of a vLLM OpenAI chat server (tests only).")
    parser.add_argument("--config", default="{}", help="FakeConfig as JSON, or @FILE holding it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: pick a free port (printed)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)
    text = open(args.config[1:]).read() if args.config.startswith("@") else args.config
    cfg = FakeConfig.from_json(text)
    _pool()  # build the token pool before announcing readiness

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        if args.parent_pid is not None:
            _watch_parent(args.parent_pid, stop)
        await serve(cfg, args.host, args.port, stop, on_ready=lambda p: print(f"LISTENING {p}", flush=True))

    asyncio.run(run())


if __name__ == "__main__":
    main()
