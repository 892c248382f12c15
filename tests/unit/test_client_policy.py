"""Deadline, retry classification and backoff policy of the generation client."""

import random

import httpx
import pytest

from eagle3.config import GenerationConfig
from eagle3.serving.client import EndpointPool, StatusError, backoff_s, classify, deadline_s, parse_response


def status_error(code, headers=None, body=None):
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    response = httpx.Response(
        code, headers=headers or {}, request=request, json=body or {"error": {"message": f"msg {code}"}}
    )
    return StatusError(response)


def test_deadline_is_derived_from_max_tokens_unless_set():
    assert deadline_s(GenerationConfig(max_tokens=32000)) == 120 + 32000 / 10
    assert deadline_s(GenerationConfig(max_tokens=256, min_tokens_per_s=2, deadline_base_s=10)) == 10 + 128
    assert deadline_s(GenerationConfig(request_timeout_s=42)) == 42


@pytest.mark.parametrize(
    "code, transient",
    [
        (408, True),
        (409, True),
        (425, True),
        (429, True),
        (500, True),
        (503, True),
        (400, False),
        (401, False),
        (404, False),
        (422, False),
    ],
)
def test_status_classification(code, transient):
    failure = classify(status_error(code))
    assert failure.kind == f"http_{code}" and failure.transient is transient
    assert failure.message == f"msg {code}"


def test_retry_after_seconds_and_http_date():
    assert classify(status_error(429, {"retry-after": "7"})).retry_after == 7.0
    dated = classify(status_error(503, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    assert dated.retry_after == 0.0  # a date in the past means "now"


def test_timeouts_and_connection_errors_are_transient():
    assert classify(TimeoutError()).kind == "timeout"
    assert classify(httpx.ReadTimeout("slow")).kind == "timeout" and classify(httpx.ReadTimeout("slow")).transient
    refused = httpx.ConnectError("refused")
    assert classify(refused).kind == "connect_error" and classify(refused).transient
    reset = httpx.RemoteProtocolError("peer closed")
    assert classify(reset).kind == "connection_error" and classify(reset).transient
    assert classify(reset).message == "RemoteProtocolError: peer closed"


def test_a_status_without_a_json_message_keeps_the_servers_text():
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    failure = classify(StatusError(httpx.Response(502, request=request, text="bad gateway")))
    assert failure.kind == "http_502" and failure.transient and "bad gateway" in failure.message
    unauthorized = classify(StatusError(httpx.Response(401, request=request, json={"error": "Unauthorized"})))
    assert unauthorized.kind == "http_401" and not unauthorized.transient and "Unauthorized" in unauthorized.message


def test_backoff_is_full_jitter_capped_and_honours_retry_after():
    gen = GenerationConfig(backoff_base_s=1, backoff_max_s=8)
    rng = random.Random(0)
    draws = [backoff_s(4, gen, None, rng) for _ in range(2000)]
    assert 0 <= min(draws) < 0.1 and 7.9 < max(draws) <= 8  # uniform over [0, min(8, 2^3)]
    assert all(backoff_s(1, gen, None, rng) <= 1 for _ in range(100))
    assert backoff_s(1, gen, 30.0, rng) == 30.0
    assert backoff_s(1, gen, 10_000.0, rng) == 80.0  # a Retry-After is capped at 10 x backoff_max_s


def test_parse_response_reads_both_reasoning_names():
    base = {
        "choices": [{"message": {"content": "a", "reasoning_content": "r"}, "finish_reason": "stop", "token_ids": [1]}],
        "prompt_token_ids": [5],
    }
    parsed = parse_response(base)
    assert (parsed["reasoning"], parsed["content"], parsed["completion_token_ids"], parsed["prompt_token_ids"]) == (
        "r",
        "a",
        [1],
        [5],
    )
    base["choices"][0]["message"]["reasoning"] = "new"
    assert parse_response(base)["reasoning"] == "new"
    with pytest.raises(Exception, match="bad_response"):
        parse_response({"choices": []})


@pytest.mark.anyio
async def test_pool_prefers_least_outstanding_and_skips_refusing_replicas():
    pool = EndpointPool(["http://a/v1", "http://b/v1"], "k", 4, 10)
    a1 = pool.acquire()
    b1 = pool.acquire()
    assert {a1.base_url, b1.base_url} == {"http://a/v1", "http://b/v1"}
    pool.release(a1, refused=True)
    assert [pool.acquire().base_url for _ in range(3)] == ["http://b/v1"] * 3
    await pool.close()


def test_a_request_takes_a_free_connection_slot_and_gives_it_back():
    """The pool's clients are small (CONNECTIONS_PER_CLIENT): a lease takes a free slot, the least busy
    client only when every slot is taken, and a release frees exactly the slot it held."""
    pool = EndpointPool(["http://a/v1"], None, max_connections=8, deadline=10)
    (e,) = pool.endpoints
    assert len(e.clients) * e.per_client >= 8 and e.per_client <= 4
    leases = [pool.acquire() for _ in range(8)]
    assert e.busy == [e.per_client] * len(e.clients) and not e.free  # every slot taken, none twice
    extra = pool.acquire()  # more requests than connections: the least busy client, over its limit
    assert e.busy[extra.index] == e.per_client + 1
    pool.release(extra)
    assert not e.free, "a release above the limit frees no slot"
    pool.release(leases[0])
    assert e.free == [leases[0].index] and pool.acquire().index == leases[0].index  # the same client, reused


@pytest.mark.parametrize("base", ["http://a:8000/v1", "http://a:8000/v1/"])
def test_a_route_is_the_replicas_base_url_and_path_parsed_once(base):
    pool = EndpointPool([base], None, max_connections=4, deadline=10)
    (e,) = pool.endpoints
    url = e.url("chat/completions")
    assert str(url) == "http://a:8000/v1/chat/completions" and e.url("chat/completions") is url
    assert e.url("/chat/completions") == url
    client = e.clients[0]  # the same URL the client's own base-URL merge gives
    assert client.build_request("POST", "chat/completions").url == url


def test_a_replica_its_supervisor_saw_die_is_benched_before_any_request_goes_to_it(tmp_path):
    import json

    from eagle3.serving import down

    events = tmp_path / "replica-events.jsonl"
    pool = EndpointPool(["http://a/v1", "http://b/v1"], None, 4, 10, events=events)
    a = pool.endpoints[0]
    try:
        down.mark_down("http://a/v1/", "its process exited (killed by SIGKILL); restart 1 under way")
        leases = [pool.acquire() for _ in range(3)]
        assert [lease.base_url for lease in leases] == ["http://b/v1"] * 3, "no request goes to the dead replica"
        assert pool.benched["http://a/v1"] == 1, "one death, one bench"
        (event,) = [json.loads(line) for line in events.read_text().splitlines()]
        assert event["event"] == "benched" and event["url"] == "http://a/v1" and "SIGKILL" in event["why"]
        down.mark_up("http://a/v1")
        a.down_until = 0.0  # what the pool's probe does once /v1/models answers (no event loop here)
        assert pool.acquire().base_url == "http://a/v1", "back in use once up: the least busy replica"
        assert pool.benched["http://a/v1"] == 1, "a replica marked up is not benched again"
    finally:
        down.mark_up("http://a/v1")
