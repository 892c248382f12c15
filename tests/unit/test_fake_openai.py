"""The fake vLLM server (tests/fake_openai/) behaves as its fault tests and benchmarks assume.

Driven through the real `openai.AsyncOpenAI` client (no retries, explicit timeouts) for what a
client sees, and raw httpx for the exact wire format.
"""

import asyncio
import os
import time

import httpx
import openai
import pytest

from fake_openai import (
    EOS,
    THINK_END,
    FakeConfig,
    FaultRule,
    completion_for,
    decode,
    ideal_seconds,
    run_fake_server,
)

# Keys of vLLM 0.32's ChatCompletionResponse.model_dump() (chat_completion/protocol.py).
VLLM_RESPONSE_KEYS = {
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
}
VLLM_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"}
VLLM_MESSAGE_KEYS = {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def client(server, timeout: float = 5.0, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=timeout)


async def chat(c: openai.AsyncOpenAI, text: str, max_tokens: int = 64, **kwargs):
    return await c.chat.completions.create(
        model="fake-target",
        messages=messages(text),
        max_tokens=max_tokens,
        extra_body={"return_token_ids": True},
        **kwargs,
    )


@pytest.fixture(scope="module")
def http():
    # One client for the module: httpx builds an SSL context per client (tens of ms each).
    with httpx.Client(timeout=5.0) as c:
        yield c


def post(http: httpx.Client, server, body: dict, headers: dict | None = None) -> httpx.Response:
    return http.post(server.base_url + "/chat/completions", json=body, headers=headers)


def test_completion_has_vllm_fields_and_is_deterministic(http):
    cfg = FakeConfig(median_tokens=50)  # with max_tokens 4096: never capped
    with run_fake_server(cfg) as server:
        body = {
            "model": "fake-target",
            "messages": messages("Tell me about owls."),
            "max_tokens": 4096,
            "return_token_ids": True,
        }
        first, second = post(http, server, body), post(http, server, body)
    assert first.status_code == 200 and first.headers["content-type"] == "application/json"
    data = first.json()
    assert set(data) == VLLM_RESPONSE_KEYS
    assert data["object"] == "chat.completion" and data["model"] == "fake-target" and data["id"].startswith("chatcmpl-")
    choice = data["choices"][0]
    assert set(choice) == VLLM_CHOICE_KEYS and set(choice["message"]) == VLLM_MESSAGE_KEYS
    ids, prompt_ids = choice["token_ids"], data["prompt_token_ids"]
    assert all(0 <= t < 4096 for t in ids + prompt_ids)
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["usage"]["completion_tokens"] == len(ids)
    assert data["usage"]["total_tokens"] == len(ids) + len(prompt_ids)
    # ids and text agree: reasoning, </think>, answer, <|im_end|>
    think_end = ids.index(THINK_END)
    assert choice["message"]["reasoning"] == decode(ids[:think_end])
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": think_end}
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None and ids[-1] == EOS
    assert choice["message"]["content"] == decode(ids[think_end + 1 : -1])
    again = second.json()
    assert again["id"] != data["id"]
    assert again["choices"] == data["choices"] and again["prompt_token_ids"] == prompt_ids
    expected_prompt_ids, expected = completion_for(cfg, messages("Tell me about owls."), 4096)
    assert expected_prompt_ids == prompt_ids and expected.token_ids == ids


def test_openai_client_sees_reasoning_and_token_ids():
    async def scenario(server):
        c = client(server)
        a, b, other = await chat(c, "same prompt"), await chat(c, "same prompt"), await chat(c, "another prompt")
        return a, b, other

    with run_fake_server(FakeConfig()) as server:
        a, b, other = asyncio.run(scenario(server))
    assert a.choices[0].message.reasoning and a.prompt_token_ids and a.choices[0].token_ids
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].token_ids == b.choices[0].token_ids
    assert a.choices[0].token_ids != other.choices[0].token_ids


def test_without_return_token_ids_or_reasoning_parser(http):
    with run_fake_server(FakeConfig(reasoning=False)) as server:
        data = post(http, server, {"messages": messages("plain"), "max_tokens": 32}).json()
    assert data["prompt_token_ids"] is None and data["choices"][0]["token_ids"] is None
    assert data["choices"][0]["message"]["reasoning"] is None
    assert data["usage"]["completion_tokens_details"] is None


def test_max_tokens_cap_gives_length_and_short_answers_stop():
    async def scenario(server):
        c = client(server)
        return await asyncio.gather(*(chat(c, f"question {i}", max_tokens=16) for i in range(20)))

    with run_fake_server(FakeConfig(median_tokens=10_000)) as server:
        capped = asyncio.run(scenario(server))
    for out in capped:
        assert out.choices[0].finish_reason == "length"
        assert len(out.choices[0].token_ids) == out.usage.completion_tokens == 16
        assert out.choices[0].message.content is None  # cut inside the reasoning
    with run_fake_server(FakeConfig(median_tokens=8)) as server:
        short = asyncio.run(scenario(server))
    assert {o.choices[0].finish_reason for o in short} == {"stop", "length"}  # heavy tail: a few still hit the cap


def test_hang_fires_the_client_timeout_without_blocking_others():
    async def scenario(server):
        hung = asyncio.create_task(chat(client(server, timeout=1.0), "please hang"))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        ok = await chat(client(server), "a normal prompt")
        normal_s = time.monotonic() - started
        with pytest.raises(openai.APITimeoutError):
            await hung
        return ok, normal_s

    with run_fake_server(FakeConfig(rules=[FaultRule("hang", "hang", times=None)])) as server:
        ok, normal_s = asyncio.run(scenario(server))
        assert ok.choices[0].finish_reason in ("stop", "length") and normal_s < 0.5
        deadline = time.monotonic() + 3
        while server.stats()["in_flight"] and time.monotonic() < deadline:  # the hang ends when the client leaves
            time.sleep(0.02)
        stats = server.stats()
    assert stats["in_flight"] == 0 and stats["faults"] == {"hang": 1}


def test_hang_s_bounds_a_hang_then_closes_the_connection():
    cfg = FakeConfig(fault_rate=1.0, fault_mix={"hang": 1.0}, hang_s=0.2)
    with run_fake_server(cfg) as server:
        started = time.monotonic()
        with pytest.raises(openai.APIConnectionError):
            asyncio.run(chat(client(server, timeout=5.0), "anything"))
    assert 0.2 <= time.monotonic() - started < 2.0


def test_429_carries_retry_after_and_the_vllm_error_body(http):
    cfg = FakeConfig(rules=[FaultRule("busy", "status", times=None, status=429, retry_after=2)])
    with run_fake_server(cfg) as server:
        with pytest.raises(openai.RateLimitError) as info:
            asyncio.run(chat(client(server), "busy now"))
        raw = post(http, server, {"messages": messages("busy now"), "max_tokens": 8})
    assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == "2"
    assert raw.status_code == 429 and raw.headers["retry-after"] == "2"
    error = raw.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 429


def test_reset_is_a_connection_error():
    with run_fake_server(FakeConfig(rules=[FaultRule("drop", "reset")])) as server:
        with pytest.raises(openai.APIConnectionError):
            asyncio.run(chat(client(server), "drop me"))
        assert asyncio.run(chat(client(server), "drop me")).choices  # times=1: the retry succeeds


def test_rule_fails_times_then_succeeds_and_rules_fire_in_order():
    rules = [FaultRule("flaky", "status", times=2, status=503), FaultRule("flaky", "status", times=1, status=500)]

    async def scenario(server):
        c, errors = client(server), []
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as info:
                await chat(c, "flaky prompt")
            errors.append(info.value.status_code)
        return errors, await chat(c, "flaky prompt")

    with run_fake_server(FakeConfig(rules=rules)) as server:
        errors, ok = asyncio.run(scenario(server))
        stats = server.stats()
    assert errors == [503, 503, 500] and ok.choices[0].token_ids
    assert stats["attempts"] == {"flaky prompt": 4} and stats["faults"] == {"503": 2, "500": 1}
    assert stats["completed"] == 1


def test_slow_answers_after_the_delay():
    with run_fake_server(FakeConfig(rules=[FaultRule("slow", "slow", delay_s=0.3)])) as server:
        started = time.monotonic()
        out = asyncio.run(chat(client(server), "slow one"))
    assert time.monotonic() - started >= 0.3 and out.choices[0].token_ids


def test_malformed_bodies(http):
    rules = [FaultRule("garbled", "malformed"), FaultRule("empty", "malformed", body='{"object":"chat.completion"}')]
    with run_fake_server(FakeConfig(rules=rules)) as server:
        garbled = post(http, server, {"messages": messages("garbled"), "max_tokens": 8})
        empty = post(http, server, {"messages": messages("empty"), "max_tokens": 8})
    assert garbled.status_code == 200
    with pytest.raises(ValueError):
        garbled.json()
    assert empty.status_code == 200 and "choices" not in empty.json()


def test_too_long_prompt_is_a_permanent_400(http):
    with run_fake_server(FakeConfig(max_prompt_chars=100)) as server:
        for _ in range(2):
            with pytest.raises(openai.BadRequestError) as info:
                asyncio.run(chat(client(server), "x" * 200))
            assert info.value.status_code == 400 and "maximum context length" in info.value.message
        error = post(http, server, {"messages": messages("x" * 200)}).json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "input_text" and error["code"] == 400


def test_request_errors_mirror_vllm(http):
    with run_fake_server(FakeConfig(max_model_len=1000)) as server:
        unknown = post(http, server, {"model": "other", "messages": messages("hi")})
        too_many = post(http, server, {"messages": messages("hi"), "max_tokens": 5000})
        no_messages = post(http, server, {"model": "fake-target"})
        route = http.get(server.url + "/v1/nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert "does not exist" in unknown.json()["error"]["message"]
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert no_messages.status_code == 400 and no_messages.json()["error"]["type"] == "BadRequestError"
    assert route.status_code == 404 and route.json() == {"detail": "Not Found"}


def test_api_key_is_required_except_for_health(http):
    with run_fake_server(FakeConfig(api_key="sekrit")) as server:
        missing = post(http, server, {"messages": messages("hi")})
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(chat(client(server, api_key="wrong"), "hi"))
        ok = asyncio.run(chat(client(server, api_key="sekrit"), "hi"))
        health = http.get(server.url + "/health")
        models = http.get(server.base_url + "/models", headers={"Authorization": "Bearer sekrit"})
        stats = server.stats()
    assert missing.status_code == 401 and missing.json() == {"error": "Unauthorized"}
    assert ok.choices[0].token_ids
    assert health.status_code == 200 and health.content == b""
    card = models.json()["data"][0]
    assert models.json()["object"] == "list" and card["id"] == "fake-target" and card["object"] == "model"
    assert stats["rejected"] == {"unauthorized": 2} and stats["completed"] == 1


def test_stats_count_attempts_per_prompt_and_reset():
    async def scenario(server):
        c = client(server)
        await asyncio.gather(chat(c, "alpha"), chat(c, "alpha"), chat(c, "beta " + "b" * 100))

    with run_fake_server(FakeConfig()) as server:
        asyncio.run(scenario(server))
        stats = server.stats()
        server.reset_stats()
        after = server.stats()
    assert stats["requests_total"] == 3 and stats["completed"] == 3
    assert stats["attempts"] == {"alpha": 2, ("beta " + "b" * 100)[:40]: 1}
    assert stats["completion_tokens"] > 0 and sum(stats["finish_reasons"].values()) == 3
    assert after["requests_total"] == 0 and after["attempts"] == {}


def test_slots_bound_concurrency_and_busy_time_gives_the_ideal():
    cfg = FakeConfig(slots=2, tokens_per_s=2000, ttft_s=0.01, median_tokens=40)
    prompts = [messages(f"task {i}") for i in range(10)]

    async def scenario(server):
        c = client(server)
        await asyncio.gather(
            *(c.chat.completions.create(model="fake-target", messages=m, max_tokens=128) for m in prompts)
        )

    with run_fake_server(cfg) as server:
        started = time.monotonic()
        asyncio.run(scenario(server))
        wall = time.monotonic() - started
        stats = server.stats()
    ideal = ideal_seconds(cfg, prompts, 128)
    assert stats["max_generating"] == 2 and stats["max_in_flight"] > 2
    assert stats["busy_slot_seconds"] == pytest.approx(ideal * 2, rel=1e-6)
    assert ideal <= wall < ideal + 1.0


def test_random_faults_are_seeded_per_attempt(http):
    cfg = FakeConfig(fault_rate=0.5, fault_mix={"429": 1.0, "5xx": 1.0}, seed=7)
    texts = [f"prompt {i}" for i in range(30)]

    def first_attempts() -> list[int]:
        with run_fake_server(cfg) as server:
            return [post(http, server, {"messages": messages(t), "max_tokens": 8}).status_code for t in texts]

    first, again = first_attempts(), first_attempts()
    assert first == again and 200 in first and 429 in first and any(s >= 500 for s in first)
    with run_fake_server(cfg) as server:
        for text in texts:  # a retry is a new draw: every prompt gets through within a few attempts
            codes = [post(http, server, {"messages": messages(text), "max_tokens": 8}).status_code for _ in range(12)]
            assert 200 in codes


def test_config_round_trips_and_rejects_nonsense():
    cfg = FakeConfig(slots=4, rules=[FaultRule("x", "status", status=503, retry_after=1.5)], fault_mix={"hang": 1})
    assert FakeConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError):
        FaultRule("x", "explode")
    with pytest.raises(ValueError):
        FaultRule("x", "status")  # no status code
    with pytest.raises(ValueError):
        FakeConfig(fault_mix={"teapot": 1.0})


def test_subprocess_mode_starts_and_stops_leaving_nothing_behind():
    with run_fake_server(FakeConfig(rules=[FaultRule("hang", "hang")]), in_thread=False) as server:
        pid = server.pid
        assert pid != os.getpid()
        with pytest.raises(openai.APITimeoutError):  # a hanging request open at shutdown must not delay it
            asyncio.run(chat(client(server, timeout=0.3), "hang"))
        out = asyncio.run(chat(client(server), "hello from a test"))
        assert out.choices[0].token_ids and server.stats()["completed"] == 1
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 3.0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
