"""Streamed requests and the decode rate they show.

Definition (what ``decode_tokens_per_s`` means everywhere in this project):
    Each request is streamed with ``return_token_ids``, so every chunk carries the token ids
    of one engine step and we know, per request i, the arrival time of the first chunk with
    tokens (t_first_i), of the last (t_last_i), the tokens in the first chunk (f_i) and in all
    (n_i). Then, over the requests of a measurement that succeeded and streamed at least two
    token chunks,

        decode_tokens_per_s = sum_i (n_i - f_i) / sum_i (t_last_i - t_first_i)

    i.e. the tokens produced after the first step divided by the time spent producing them:
    the token-weighted decode speed of one stream, with time to first token (queueing,
    prefill) left out. At concurrency c it is still the speed one user sees; the cell's
    aggregate rate (all completion tokens / wall time of the batch, prefill included) is
    recorded beside it as ``throughput_tokens_per_s``.

Design choices:
- One thread per in-flight request with a synchronous httpx client: works whether or not the
  caller runs an event loop (Prefect tasks may), and needs no extra dependency.
- Every request has explicit connect/read timeouts and an overall deadline checked between
  chunks; no retries: a failed request is counted, never silently replaced (the counters
  would still include its drafts).
- The token ids are kept per prompt so greedy outputs can be compared across methods.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

DECODE_RATE_DEFINITION = (
    "streamed with return_token_ids; per request i: n_i completion tokens, f_i tokens in the first chunk that carried "
    "tokens, t_first_i / t_last_i arrival of the first / last chunk with tokens; decode_tokens_per_s = "
    "sum_i (n_i - f_i) / sum_i (t_last_i - t_first_i) over successful requests with at least two token chunks "
    "(time to first token excluded; the speed one stream sees, also at concurrency > 1). "
    "throughput_tokens_per_s = all completion tokens / wall time of the batch (prefill and queueing included)."
)


@dataclass
class Streamed:
    """One request's outcome: an error kind, or its token ids and chunk arrival times."""

    error: str | None = None
    token_ids: list[int] = field(default_factory=list)
    first_chunk_tokens: int = 0
    ttft_s: float | None = None  # request sent -> first chunk with tokens
    decode_s: float | None = None  # first chunk with tokens -> last chunk with tokens
    chunks: int = 0
    usage_tokens: int | None = None
    prompt_token_ids: list[int] | None = None  # vLLM sends them in the first chunk (return_token_ids)

    @property
    def decode_tokens(self) -> int:
        return len(self.token_ids) - self.first_chunk_tokens


def _chunk_tokens(event: dict) -> list[int]:
    choices = event.get("choices") or []
    ids = choices[0].get("token_ids") if choices and isinstance(choices[0], dict) else None
    return [int(t) for t in ids] if isinstance(ids, list) else []


def _read_stream(response: httpx.Response, out: Streamed, sent: float, deadline: float) -> Streamed:
    first = last = None
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            out.error = "deadline"
            return out
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            out.error = "stream_error"
            return out
        if out.prompt_token_ids is None and isinstance(event.get("prompt_token_ids"), list):
            out.prompt_token_ids = [int(t) for t in event["prompt_token_ids"]]
        if event.get("usage"):
            out.usage_tokens = event["usage"].get("completion_tokens")
        ids = _chunk_tokens(event)
        if ids:
            last = time.monotonic()
            if first is None:
                first, out.first_chunk_tokens = last, len(ids)
            out.token_ids += ids
            out.chunks += 1
    if first is None:
        out.error = "no_tokens"
        return out
    out.ttft_s, out.decode_s = first - sent, last - first
    return out


def stream_request(client: httpx.Client, url: str, headers: dict, body: dict, total_timeout_s: float) -> Streamed:
    """POST one streamed chat completion; never raises for a request-level failure."""
    sent = time.monotonic()
    try:
        with client.stream("POST", url, headers=headers, json=body) as response:
            if response.status_code != 200:
                response.read()
                return Streamed(error=f"http_{response.status_code}")
            return _read_stream(response, Streamed(), sent, sent + total_timeout_s)
    except httpx.TimeoutException:
        return Streamed(error="timeout")
    except httpx.HTTPError as exc:
        return Streamed(error=type(exc).__name__)
    except (ValueError, TypeError, AttributeError, KeyError):
        return Streamed(error="bad_response")


def request_body(model: str, prompt: dict, *, temperature: float, top_p: float, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": prompt["messages"],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p if temperature > 0 else 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def run_batch(
    base_url: str,
    api_key: str | None,
    model: str,
    prompts: list[dict],
    *,
    temperature: float,
    top_p: float,
    max_tokens: int,
    concurrency: int,
    timeout_s: float,
) -> tuple[list[Streamed], float]:
    """Every prompt once, at most ``concurrency`` in flight; (outcomes in prompt order, wall seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    workers = max(1, min(concurrency, len(prompts)))
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    bodies = [request_body(model, p, temperature=temperature, top_p=top_p, max_tokens=max_tokens) for p in prompts]
    url = f"{base_url}/chat/completions"
    began = time.monotonic()
    with (
        httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False) as client,
        ThreadPoolExecutor(workers) as pool,
    ):
        outcomes = list(pool.map(lambda b: stream_request(client, url, headers, b, timeout_s), bodies))
    return outcomes, time.monotonic() - began


def summarize(outcomes: list[Streamed], wall_s: float) -> dict:
    """Counts and rates of one batch (see the module docstring for the decode-rate definition)."""
    ok = [o for o in outcomes if o.error is None]
    timed = [o for o in ok if o.chunks >= 2 and o.decode_s and o.decode_s > 0]
    errors = Counter(o.error for o in outcomes if o.error)
    tokens = sum(len(o.token_ids) for o in ok)
    return {
        "requests": len(outcomes),
        "requests_ok": len(ok),
        "requests_failed": len(outcomes) - len(ok),
        "errors": dict(errors),
        "completion_tokens": tokens,
        "decode_tokens": sum(o.decode_tokens for o in timed),
        "decode_s": sum(o.decode_s for o in timed),
        "ttft_s_sum": sum(o.ttft_s for o in ok),
        "wall_s": wall_s,
        "usage_mismatch": sum(1 for o in ok if o.usage_tokens is not None and o.usage_tokens != len(o.token_ids)),
    }


def rates(stats: dict) -> dict:
    """Rates of summed batch stats: decode tokens/s, throughput, mean time to first token."""
    return {
        "decode_tokens_per_s": stats["decode_tokens"] / stats["decode_s"] if stats["decode_s"] > 0 else None,
        "throughput_tokens_per_s": stats["completion_tokens"] / stats["wall_s"] if stats["wall_s"] > 0 else None,
        "mean_ttft_s": stats["ttft_s_sum"] / stats["requests_ok"] if stats["requests_ok"] else None,
    }


ADDITIVE = (
    "requests",
    "requests_ok",
    "requests_failed",
    "completion_tokens",
    "decode_tokens",
    "decode_s",
    "ttft_s_sum",
    "wall_s",
    "usage_mismatch",
)


def add_stats(a: dict, b: dict) -> dict:
    """Two batches' stats together (rounds of one cell pool into one estimate)."""
    errors = Counter(a["errors"])
    errors.update(b["errors"])
    return {**{k: a[k] + b[k] for k in ADDITIVE}, "errors": dict(errors)}
