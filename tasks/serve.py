"""The target's server for the length of a flow: managed (started and stopped here) or external.

The API key never becomes a task parameter (parameters are shown in the UI): shard
tasks get the *name* of an environment variable that holds it in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.generate.stage import expected_target  # noqa: F401  (flows import it from here)

MANAGED_KEY_ENV = "EAGLE3_MANAGED_SERVER_KEY"


@dataclass(frozen=True)
class Target:
    urls: tuple[str, ...]
    key_env: str
    model: str  # the name requests use
    template_hash: str


def _launcher(config: PipelineConfig) -> list[str]:
    server = config.server
    return list(server.command) if server.command else [server.python, "-m", "vllm.entrypoints.openai.api_server"]


@contextlib.asynccontextmanager
async def _managed(config: PipelineConfig, logger) -> AsyncIterator[Target]:
    from eagle3.models import resolve_model, template_hash
    from eagle3.serving.managed import ManagedServer

    server = config.server
    model_path = await asyncio.to_thread(resolve_model, server.model)
    name = server.served_model_name or model_path
    managed = ManagedServer(
        command=_launcher(config), model=model_path, served_model_name=name, host=server.host,
        extra_args=list(server.args), env=dict(server.env), log_path=Path(config.run_dir) / "generations" / "server.log",
        startup_timeout_s=server.startup_timeout_s, stop_grace_s=server.stop_grace_s, logger=logger,
    )
    try:
        await asyncio.to_thread(managed.start)
        os.environ[MANAGED_KEY_ENV] = managed.api_key
        yield Target((managed.base_url,), MANAGED_KEY_ENV, name, template_hash(model_path))
        # A server that died mid-run shows up as connection failures in the shards; say why.
        managed.check()
    finally:
        os.environ.pop(MANAGED_KEY_ENV, None)
        await asyncio.to_thread(managed.stop)


@contextlib.asynccontextmanager
async def _external(config: PipelineConfig, logger) -> AsyncIterator[Target]:
    from eagle3.serving.external import check_replicas

    server = config.server
    if not server.urls:
        raise ValueError("server.mode = external needs server.urls (OpenAI base URLs ending in /v1)")
    healthy, bad = await check_replicas(list(server.urls), os.environ.get(server.api_key_env))
    for url, why in bad.items():
        logger.warning("replica %s is not usable: %s", url, why)
    if not healthy:
        raise RuntimeError(f"no replica of {server.urls} answered /health and /v1/models: {bad}")
    yield Target(tuple(healthy), server.api_key_env, server.served_model_name or server.model, "")


def target_server(config: PipelineConfig, logger):
    """``async with target_server(config, logger) as target:`` -> URLs, key env var, model name."""
    return _managed(config, logger) if config.server.mode == "managed" else _external(config, logger)
