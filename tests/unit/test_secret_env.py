"""eagle3/secret_env.py: the children the pipeline starts inherit none of its credentials.

Each kind of child is checked where its environment is built: the helper itself, torchrun's (one
machine and a cluster node's), the vLLM extraction worker's, a child group's guard, the temporary
Prefect server's. The managed vLLM server's, started, is in test_managed_server.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3 import orphans
from eagle3.secret_env import PREFECT_SERVER_SECRETS, SECRET_ENV, child_env

# One value per kind of credential the pipeline's process may hold, plus a custom server.api_key_env.
CREDENTIALS = {
    "PREFECT_API_AUTH_STRING": "admin:prefect-secret",
    "PREFECT_API_KEY": "pnu_cloud-secret",
    "PREFECT_SERVER_API_AUTH_STRING": "admin:server-secret",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect:db-secret@db/prefect",
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_old_secret",
    "OPENAI_API_KEY": "sk-secret",
    "EAGLE3_API_KEY": "external-secret",
    "EAGLE3_MANAGED_SERVER_KEY": "managed-secret",
    "VLLM_API_KEY": "stray-secret",
    "MY_VLLM_KEY": "custom-named-secret",
}
CUSTOM = ("MY_VLLM_KEY",)


@pytest.fixture()
def credentials(monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("EAGLE3_HARMLESS", "kept")
    return CREDENTIALS


def leaked(env: dict[str, str] | str) -> list[str]:
    text = env if isinstance(env, str) else "\0".join(f"{k}={v}" for k, v in env.items())
    return sorted(name for name, value in CREDENTIALS.items() if value in text)


def environ_of(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode()


def test_child_env_drops_the_credentials_and_keeps_the_rest(credentials):
    env = child_env(drop=CUSTOM)
    assert leaked(env) == []
    assert env["EAGLE3_HARMLESS"] == "kept" and env["PATH"] == os.environ["PATH"]
    assert leaked(child_env()) == ["MY_VLLM_KEY"], "a custom name goes only when the caller names it"
    kept = child_env(keep=PREFECT_SERVER_SECRETS)
    assert {n for n in PREFECT_SERVER_SECRETS if n in kept} == {n for n in PREFECT_SERVER_SECRETS if n in credentials}
    assert child_env({"HF_TOKEN": "x", "A": "1"}) == {"A": "1"}, "a given base is scrubbed, not os.environ"


def test_the_list_names_the_pipelines_own_key_variables():
    from eagle3.config import ServerConfig
    from eagle3.serving.target import MANAGED_KEY_ENV

    assert MANAGED_KEY_ENV in SECRET_ENV
    assert ServerConfig().api_key_env in SECRET_ENV
    assert set(CREDENTIALS) - set(CUSTOM) <= SECRET_ENV


def test_torchrun_inherits_no_credential(credentials, monkeypatch):
    from eagle3.cluster.train import torchrun_env as cluster_env
    from eagle3.torchrun import torchrun_env

    # Another test in the same worker (or an import: Ray sets it) may have left OMP_NUM_THREADS set; the
    # environment's setting wins over the argument, so both cases are asked for here.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = torchrun_env(2, drop=CUSTOM)
    assert leaked(env) == [] and env["EAGLE3_HARMLESS"] == "kept" and env["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torchrun_env(2, drop=CUSTOM)["OMP_NUM_THREADS"] == "3"
    assert leaked(cluster_env(2)) == [], "what the driver sends to the nodes"


def test_the_vllm_extraction_worker_inherits_no_credential(credentials):
    from eagle3.extract.vllm_backend import _worker_env

    env = _worker_env({"VLLM_CPU_KVCACHE_SPACE": 1}, CUSTOM)
    assert leaked(env) == [] and env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc")
def test_a_cluster_nodes_torchrun_and_a_childs_guard_inherit_no_credential(credentials):
    """A node's torchrun gets the node's environment less its credentials (a node's pods may carry a
    Hugging Face token); the guard of its group lives as long as it and needs none either."""
    from eagle3.cluster.train import NodeRunner

    runner = NodeRunner(0)
    pid = runner.start(["python", "-c", "import time; time.sleep(60)"], {"OMP_NUM_THREADS": "1"}, CUSTOM)
    try:
        torchrun = environ_of(pid)
        guard = orphans._guards[pid].proc.pid
        guarding = environ_of(guard)
    finally:
        runner.stop()
    assert leaked(torchrun) == [] and "EAGLE3_HARMLESS=kept" in torchrun and "OMP_NUM_THREADS=1" in torchrun
    assert leaked(guarding) == ["MY_VLLM_KEY"], "the guard knows secret_env's names only"


def test_the_temporary_prefect_server_keeps_prefects_settings_only(credentials, monkeypatch):
    """It is a Prefect server: a credential set for Prefect is its business; the others are not."""
    from cli import prefect_server

    seen = {}

    class FakeChild:
        def __init__(self, argv, *, env, **_):
            seen.update(env)

        def start(self):
            return self

    monkeypatch.setattr(prefect_server, "Child", FakeChild)
    monkeypatch.setattr(prefect_server, "_point_prefect_at", lambda env: None)
    prefect_server.TemporaryServer(CUSTOM).start()
    prefect_names = {n for n in CREDENTIALS if n.startswith("PREFECT_")}
    assert leaked(seen) == sorted(prefect_names)
    assert "PREFECT_API_URL" not in seen and seen["EAGLE3_HARMLESS"] == "kept"
