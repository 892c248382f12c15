"""One chat request with an explicit deadline, our own retries, and a classified outcome.

Design choices:
- Requests go out through httpx directly, not the openai client: its request building
  (a recursive type-driven transform of every message), response wrapping and retry
  layers cost ~1 ms of CPU per request, ~40% of the client's whole cost against an
  instant server (benchmarks/bench_generation.py), and we used none of them: the body
  is the vLLM chat body, the answer is read as JSON, and the retries are ours (the
  openai client's own would silently regenerate from scratch and hide failures). Every
  retry here is counted by kind.
- Every attempt has a hard total deadline (``asyncio.timeout``) on top of the HTTP
  client's timeouts, which only bound each read: a server that trickles bytes cannot
  hold a request forever. The deadline is set, or derived from ``max_tokens``:
  ``deadline_base_s + max_tokens / min_tokens_per_s`` (documented with the knobs).
- Only transient failures are retried: timeouts, connection errors, and HTTP
  408/409/425/429/5xx. Waits use exponential backoff with full jitter (uniform in
  ``[0, min(max, base * 2^(attempt-1))]``), and a server's Retry-After is honoured.
  Permanent failures (400 prompt too long, 401, 404, ...) are recorded once with the
  server's own message.
- Replicas are chosen by least outstanding requests, and a retry goes to another replica
  than the one that just failed when there is one. A replica that refuses connections
  (or drops two in a row) is *benched*: no request goes to it until a probe of its
  ``/v1/models`` (every ``PROBE_EVERY_S``, with the key) answers 200. Probing instead of
  sending real requests means a dead replica costs each prompt at most the attempt that
  found it dead, however long it stays down. A managed server whose supervisor runs in this
  process is benched before any request finds it dead: the supervisor marks it down when its
  process exits (eagle3/serving/down.py).
- When every replica is benched (the one managed server is restarting; an operator is
  restarting the fleet) requests *wait* for one to come back instead of spending their
  attempts in a few seconds of backoff -- bounded by ``outage_wait_s`` per outage, after
  which they go out, fail, and the shard task's retry takes over.
- Each replica is served by many small HTTP clients (``CONNECTIONS_PER_CLIENT`` = 4
  connections each) rather than one big one: httpcore scans its whole pool, a ``poll()``
  per connection, several times for every request, so the scan is most of the client's
  CPU (one client with 1024 connections: ~45 req/s). Measured with a plain httpx script
  against an instant server at 64-1024 in flight: client CPU per request ~2.1 ms with
  32 connections per client, ~1.0-1.4 with 8, ~0.9-1.2 with 4 and with 2. A request takes
  a free connection slot from a stack (O(1), and the client that just answered is reused,
  its connection still open); when none is free (more requests than connections) the
  least busy client takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import random
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3.config import GenerationConfig
from eagle3.errors import Eagle3Error
from eagle3.records import JsonlAppender
from eagle3.serving import down

TRANSIENT_STATUS = {408, 409, 425, 429}
# A benched replica comes back when a probe answers; without a running event loop (no
# probe possible) it comes back after BENCH_S. A running probe keeps extending the bench.
BENCH_S = 30.0
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
# One dropped connection can be a single bad request; two in a row with no success between is the replica.
DROPS_BEFORE_BENCH = 2
WAIT_POLL_S = 0.25
CONNECTIONS_PER_CLIENT = 4


def deadline_s(gen: GenerationConfig) -> float:
    """The per-request deadline: the configured one, else derived from max_tokens."""
    if gen.request_timeout_s is not None:
        return gen.request_timeout_s
    return gen.deadline_base_s + gen.max_tokens / gen.min_tokens_per_s


@dataclass
class Failure(Eagle3Error):
    """One request's failure; ``transient`` (per failure, not per class) decides whether it is retried."""

    kind: str
    message: str
    transient: bool
    retry_after: float | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass
class Endpoint:
    base_url: str
    clients: list[httpx.AsyncClient]
    per_client: int = 1  # connections each client may hold
    outstanding: int = 0
    down_until: float = 0.0
    busy: list[int] = field(default_factory=list)  # requests in flight per client
    free: list[int] = field(default_factory=list)  # one client index per free connection slot (a stack)
    drops: int = 0  # connection failures since the last answer
    probe: asyncio.Task | None = None

    urls: dict[str, httpx.URL] = field(default_factory=dict)  # route -> its absolute URL, parsed once

    def __post_init__(self) -> None:
        self.busy = [0] * len(self.clients)
        self.free = [i for i in reversed(range(len(self.clients))) for _ in range(self.per_client)]

    def url(self, path: str) -> httpx.URL:
        """``path`` under this replica's base URL, parsed once: httpx parses and quotes a string path
        and merges it with the client's base URL on every request (~40 us of CPU, ~4% of a request's
        client cost against an instant server; benchmarks/bench_generation.py)."""
        url = self.urls.get(path)
        if url is None:
            url = self.urls[path] = httpx.URL(self.base_url.rstrip("/") + "/" + path.lstrip("/"))
        return url

    def take(self) -> int:
        """A client for one more request: a free slot's, else the least busy one's (over its limit)."""
        index = self.free.pop() if self.free else min(range(len(self.busy)), key=self.busy.__getitem__)
        self.busy[index] += 1
        return index

    def give_back(self, index: int) -> None:
        self.busy[index] -= 1
        if self.busy[index] < self.per_client:
            self.free.append(index)


@dataclass
class Lease:
    """One request's hold on a replica and one of its HTTP clients."""

    endpoint: Endpoint
    index: int

    @property
    def client(self) -> httpx.AsyncClient:
        return self.endpoint.clients[self.index]

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url


class EndpointPool:
    """Replicas of one model; each request goes to the healthy one with the fewest in flight.

    outage_wait_s: how long requests wait while every replica is benched (0: never wait).
    benched: {base URL: times benched}, for the task's log.
    events: a JSONL file that gets one line per bench and return ({"at", "event", "url", "why"}),
    appended as it happens, so the run's manifest can count them across shard tasks and retries.
    """

    def __init__(
        self,
        base_urls: list[str],
        api_key: str | None,
        max_connections: int,
        deadline: float,
        outage_wait_s: float = 0.0,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
        events: str | Path | None = None,
    ):
        if not base_urls:
            raise ValueError("no server URLs to send requests to")
        n_clients = max(1, -(-max_connections // CONNECTIONS_PER_CLIENT))
        per_client = -(-max_connections // n_clients)
        # One TLS context for every client: httpx builds a new one per client by default, loading the CA
        # bundle each time (~40 ms of CPU per client; 1024 connections are 256 clients).
        self._tls = httpx.create_ssl_context()
        self.endpoints = []
        for url in base_urls:
            clients = [_client(url, api_key, per_client, deadline, self._tls) for _ in range(n_clients)]
            self.endpoints.append(Endpoint(url, clients, per_client))
        self.outage_wait_s = outage_wait_s
        self.log = logger or logging.getLogger(__name__)
        self.benched: Counter = Counter()
        self._api_key = api_key
        self._outage_since: float | None = None
        self._events = Path(events) if events is not None else None

    def bench(self, base_url: str, why: str) -> None:
        """Take a replica out of use until /v1/models answers (one that was down when the run began)."""
        self._bench(next(e for e in self.endpoints if e.base_url == base_url), why)

    def _note(self, event: str, e: Endpoint, why: str) -> None:
        if self._events is not None:
            with JsonlAppender(self._events, what="replica event") as out:
                out.append({"at": round(time.time(), 3), "event": event, "url": e.base_url, "why": why})

    def _up(self, now: float) -> list[Endpoint]:
        return [e for e in self.endpoints if e.down_until <= now]

    def acquire(self, avoid: Endpoint | None = None) -> Lease:
        """A lease on the least busy replica that is up, other than ``avoid`` when possible."""
        self._bench_known_down()
        up = self._up(time.monotonic())
        candidates = [e for e in up if e is not avoid] or up or sorted(self.endpoints, key=lambda e: e.down_until)[:1]
        chosen = min(candidates, key=lambda e: e.outstanding)
        chosen.outstanding += 1
        return Lease(chosen, chosen.take())

    def release(self, lease: Lease, refused: bool = False, failure: Failure | None = None) -> None:
        """Give the lease back with what happened: success (no failure), refused, or a classified failure."""
        e = lease.endpoint
        e.outstanding -= 1
        e.give_back(lease.index)
        kind = "connect_error" if refused else (failure.kind if failure else None)
        if kind is None:
            e.drops = 0
            self._unbench(e, "answered a request")
        elif kind == "connect_error":
            e.drops += 1
            self._bench(e, "refuses connections")
        elif kind == "connection_error":
            e.drops += 1
            if e.drops >= DROPS_BEFORE_BENCH:
                self._bench(e, f"dropped {e.drops} connections in a row")
        elif kind.startswith("http_"):
            e.drops = 0  # it answered: alive, whatever it said

    def _bench_known_down(self) -> None:
        """Bench each replica whose supervisor in this process has seen it die (eagle3/serving/down.py)."""
        if not down.any_down():  # the usual case: one check per request
            return
        for e in self.endpoints:
            if (why := down.why_down(e.base_url)) is not None:
                self._bench(e, why)

    def _bench(self, e: Endpoint, why: str) -> None:
        now = time.monotonic()
        if e.down_until > now:
            return  # already benched: one outage, one bench
        e.down_until = now + BENCH_S
        self.benched[e.base_url] += 1
        self.log.warning(
            "replica %s %s: benched, its requests go elsewhere until /v1/models answers again", e.base_url, why
        )
        self._note("benched", e, why)
        try:
            e.probe = asyncio.get_running_loop().create_task(self._probe_until_back(e))
        except RuntimeError:
            pass  # no loop (sync caller): the bench ends after BENCH_S

    def _unbench(self, e: Endpoint, why: str) -> None:
        if e.down_until == 0.0:
            return
        e.down_until, e.drops = 0.0, 0
        self.log.warning("replica %s %s: back in use", e.base_url, why)
        self._note("back", e, why)
        if e.probe is not None and e.probe is not asyncio.current_task():
            e.probe.cancel()
        e.probe = None

    async def _probe_until_back(self, e: Endpoint) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT, headers=headers, verify=self._tls) as http:
            while e.down_until > 0.0:
                await asyncio.sleep(PROBE_EVERY_S)
                try:
                    answered = (await http.get(f"{e.base_url.rstrip('/')}/models")).status_code == 200
                except httpx.HTTPError:
                    answered = False
                if answered:
                    self._unbench(e, "answers /v1/models again")
                    return
                # Still down: keep it benched while we look (the timer is only the no-probe fallback).
                e.down_until = max(e.down_until, time.monotonic() + BENCH_S)

    async def wait_available(self) -> None:
        """Hold the caller while every replica is benched, for at most outage_wait_s per outage."""
        if self.outage_wait_s <= 0:
            return
        self._bench_known_down()
        while not self._up(now := time.monotonic()):
            if self._outage_since is None:
                self._outage_since = now
                self.log.warning(
                    "every replica is benched: requests wait up to %.0f s for one to answer again", self.outage_wait_s
                )
            if now - self._outage_since >= self.outage_wait_s:
                return  # waited long enough: requests go out, fail, and the shard retry takes over
            await asyncio.sleep(WAIT_POLL_S)
        if self._outage_since is not None:
            self.log.warning(
                "a replica is back after %.1f s with every replica benched", time.monotonic() - self._outage_since
            )
            self._outage_since = None

    async def close(self) -> None:
        for e in self.endpoints:
            if e.probe is not None:
                e.probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await e.probe
                e.probe = None
            for client in e.clients:
                await client.aclose()


def _client(
    base_url: str, api_key: str | None, max_connections: int, deadline: float, tls: ssl.SSLContext
) -> httpx.AsyncClient:
    """One small HTTP client: its own pool, the key on every request, and read/connect timeouts
    under the per-attempt deadline (which bounds the whole request)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(deadline, connect=min(30.0, deadline))
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/") + "/", limits=limits, timeout=timeout, headers=headers, verify=tls
    )


class StatusError(Eagle3Error):
    """The server answered with an HTTP error status; ``body`` is its JSON, or its text when not JSON.
    Transient or not per instance, by its code (TRANSIENT_STATUS and 5xx are), as ``classify`` reads it."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.status_code = response.status_code
        self.transient = self.status_code in TRANSIENT_STATUS or self.status_code >= 500
        text = response.text.strip()
        try:
            self.body: Any = json.loads(text)
        except ValueError:
            self.body = text
        self.message = f"Error code: {self.status_code}" + (f" - {self.body}" if self.body else "")
        super().__init__(self.message)


def _retry_after(response: httpx.Response | None) -> float | None:
    value = response.headers.get("retry-after") if response is not None else None
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def _server_message(exc: StatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return exc.message


def classify(exc: BaseException) -> Failure:
    """Map an exception from one attempt to a counted kind, transient or not."""
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return Failure("timeout", "no complete response within the request deadline", True)
    if isinstance(exc, (httpx.TransportError, OSError)):  # refused, reset, closed mid-answer, protocol errors
        kind = "connect_error" if isinstance(exc, httpx.ConnectError) else "connection_error"
        return Failure(kind, f"{type(exc).__name__}: {exc}", True)
    if isinstance(exc, StatusError):
        code = exc.status_code
        return Failure(f"http_{code}", _server_message(exc), exc.transient, _retry_after(exc.response))
    if isinstance(exc, Failure):
        return exc
    return Failure("bad_response", f"{type(exc).__name__}: {exc}", True)


def backoff_s(attempt: int, gen: GenerationConfig, retry_after: float | None, rng: random.Random) -> float:
    wait = rng.uniform(0.0, min(gen.backoff_max_s, gen.backoff_base_s * 2 ** (attempt - 1)))
    if retry_after is not None:
        wait = max(wait, min(retry_after, 10 * gen.backoff_max_s))
    return wait


@dataclass
class Stats:
    """Live counters for progress lines and artifacts."""

    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    filtered: int = 0
    in_flight: int = 0
    completion_tokens: int = 0
    turns: int = 0  # regenerate mode: earlier turns answered (the last turn of a conversation counts in done)
    shortened: int = 0  # regenerate mode: conversations kept shorter after a failure
    retries: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def snapshot(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        finished = self.done + self.filtered
        return {
            "total": self.total,
            "skipped": self.skipped,
            "done": self.done,
            "filtered": self.filtered,
            "failed": self.failed,
            "in_flight": self.in_flight,
            "elapsed_s": round(elapsed, 1),
            "req_per_s": round(finished / elapsed, 2),
            "tokens_per_s": round(self.completion_tokens / elapsed, 1),
            "mean_completion_tokens": round(self.completion_tokens / finished, 1) if finished else 0.0,
            "retries": dict(self.retries),
            "errors": dict(self.errors),
            **({"turns": self.turns, "shortened": self.shortened} if self.turns or self.shortened else {}),
        }


def parse_response(data: Any) -> dict:
    """The fields we keep from a vLLM chat completion (reasoning under either name)."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        return {
            "prompt_token_ids": data.get("prompt_token_ids"),
            "completion_token_ids": choice.get("token_ids"),
            "reasoning": message.get("reasoning")
            if message.get("reasoning") is not None
            else message.get("reasoning_content"),
            "content": message.get("content"),
            "finish_reason": choice["finish_reason"],
            "usage": data.get("usage"),
            "model": data.get("model"),
        }
    except (KeyError, IndexError, TypeError) as exc:
        raise Failure("bad_response", f"response lacks {exc!r}: {str(data)[:200]}", True) from None


async def _post(lease: Lease, path: str, body: dict, deadline: float) -> dict:
    """One attempt: POST the body as JSON and read the whole answer, all inside the deadline."""
    content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    async with asyncio.timeout(deadline):
        response = await lease.client.post(lease.endpoint.url(path), content=content)
    if response.status_code >= 400:
        raise StatusError(response)
    try:
        return json.loads(response.content)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise Failure("bad_response", f"body is not JSON ({exc})", True) from None


def parse_completion(data: Any) -> dict:
    """The fields we keep from a vLLM text completion with n choices (``/v1/completions``)."""
    try:
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return {
            "choices": [
                {"text": c["text"], "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason")}
                for c in choices
            ],
            "usage": data.get("usage"),
            "model": data.get("model"),
        }
    except (KeyError, TypeError) as exc:
        raise Failure("bad_response", f"response lacks {exc!r}: {str(data)[:200]}", True) from None


# What one request is: the chat route (generate) or the text-completion route (self-written prompts).
# Both share the retry, backoff, deadline and replica policy below.
ROUTES = {"chat": ("chat/completions", parse_response), "completions": ("completions", parse_completion)}


async def request_with_retries(
    pool: EndpointPool, body: dict, gen: GenerationConfig, stats: Stats, rng: random.Random, route: str = "chat"
) -> tuple[dict | None, Failure | None, int, float]:
    """Run one prompt to a parsed result or a final failure: (result, failure, attempts, latency_s)."""
    path, parse = ROUTES[route]
    deadline = deadline_s(gen)
    started = time.monotonic()
    last = None
    for attempt in range(1, gen.max_attempts + 1):
        await pool.wait_available()
        endpoint = pool.acquire(avoid=last)
        try:
            result = parse(await _post(endpoint, path, body, deadline))
            pool.release(endpoint)
            return result, None, attempt, time.monotonic() - started
        except (Exception, TimeoutError) as exc:  # every attempt's failure is classified, none escapes
            failure = classify(exc)
            pool.release(endpoint, failure=failure)
            last = endpoint.endpoint
        if not failure.transient or attempt == gen.max_attempts:
            return None, failure, attempt, time.monotonic() - started
        stats.retries[failure.kind] += 1
        await asyncio.sleep(backoff_s(attempt, gen, failure.retry_after, rng))
    raise AssertionError("unreachable")
