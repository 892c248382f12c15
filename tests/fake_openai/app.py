"""Routing, auth, fault decisions and the latency model; knows nothing of sockets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable

from .bodies import (
    CLOSE,
    RESET,
    Reply,
    _json_reply,
    chat_body,
    completion_body,
    completion_choice,
    error_body,
    models_body,
    too_long_body,
)
from .config import MALFORMED_BODY, SERVER_ERRORS, FakeConfig
from .model import Completion, Prompt, _uniforms, make_completion, make_prompt, work_seconds


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
