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
Standalone: python tests/fake_openai --port 8000 --config '{"slots": 8, "tokens_per_s": 100}'

Modules: config (FakeConfig, FaultRule), model (the fake tokenizer and the deterministic
completions), bodies (vLLM's JSON bodies), app (routing, auth, faults, latency), wire (HTTP/1.1
over asyncio), server (running it from tests and the command line). Tests import every name
from the package.
"""

from .app import FakeApp, Fault, Stats
from .bodies import (
    CLOSE,
    RESET,
    Reply,
    chat_body,
    completion_body,
    completion_choice,
    error_body,
    models_body,
    too_long_body,
)
from .config import FAULT_KINDS, MALFORMED_BODY, MIX_KINDS, SERVER_ERRORS, FakeConfig, FaultRule
from .model import (
    EOS,
    FIRST_WORD,
    IM_START,
    ROLE_IDS,
    THINK_END,
    THINK_START,
    VOCAB_SIZE,
    Completion,
    Prompt,
    completion_for,
    decode,
    encode_text,
    ideal_seconds,
    ideal_throughput,
    make_completion,
    make_prompt,
    natural_length,
    vocabulary,
    work_seconds,
)
from .server import FakeServer, main, run_fake_server, wait_healthy
from .wire import HttpConnection, serve

__all__ = [
    "CLOSE",
    "Completion",
    "EOS",
    "FAULT_KINDS",
    "FIRST_WORD",
    "FakeApp",
    "FakeConfig",
    "FakeServer",
    "Fault",
    "FaultRule",
    "HttpConnection",
    "IM_START",
    "MALFORMED_BODY",
    "MIX_KINDS",
    "Prompt",
    "RESET",
    "ROLE_IDS",
    "Reply",
    "SERVER_ERRORS",
    "Stats",
    "THINK_END",
    "THINK_START",
    "VOCAB_SIZE",
    "chat_body",
    "completion_body",
    "completion_choice",
    "completion_for",
    "decode",
    "encode_text",
    "error_body",
    "ideal_seconds",
    "ideal_throughput",
    "main",
    "make_completion",
    "make_prompt",
    "models_body",
    "natural_length",
    "run_fake_server",
    "serve",
    "too_long_body",
    "vocabulary",
    "wait_healthy",
    "work_seconds",
]
