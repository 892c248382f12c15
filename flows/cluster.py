"""Shard tasks on the Ray cluster that ``[cluster]`` names, through prefect-ray's task runner.

A stage placed on the cluster hands its shard tasks to prefect-ray's ``RayTaskRunner`` inside the
stage's own flow run (not a nested flow: a subflow costs a second of Prefect's bookkeeping per
stage, measured in benchmarks/README.md): each task is a Ray task asking for the stage's
resources (``cluster.<stage>_cpus`` / ``_gpus``) and runs the same Prefect task as on one machine,
so its logs, retries, markers and accounting are unchanged and it shows in the UI under the stage's
flow run as today. Ray reruns a task whose worker or node died (``cluster.task_max_retries``); the shard's
disk markers make the rerun redo only what that shard had not finished. Every shard is waited for
before the first failure is raised, so the shards that could finish are on disk for the resume.

Imported only when an address is set: the stage flows import this module inside the branch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prefect import get_run_logger
from prefect.tasks import Task
from prefect.utilities.callables import get_call_parameters

from eagle3.config import PipelineConfig
from eagle3.errors import TransientError
from eagle3.progress import report


class ShardLost(TransientError, RuntimeError):
    """A shard task's worker died more often than cluster.task_max_retries allows."""


def _options(config: PipelineConfig, cpus: float, gpus: float) -> dict:
    """Ray's options for each shard task. The runtime_env carries the working directory only: Ray records
    a task's runtime_env in its task events, which anyone who can read the cluster's state sees, so a
    secret a task needs travels as one of its arguments (flows/generate.py: the server's API key)."""
    from eagle3.cluster import workdir_env

    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "max_retries": config.cluster.task_max_retries,
        "runtime_env": workdir_env(os.getcwd()),
    }


def _runner(config: PipelineConfig, stage: str, cpus: float, gpus: float):
    """Join the cluster, refuse a request no node can hold, and the task runner for the nested flow."""
    from prefect_ray import RayTaskRunner

    from eagle3.cluster import check_resources, connect, init_kwargs

    ray = connect(config.cluster)
    check_resources(ray, stage, {"CPU": cpus, "GPU": gpus})
    return ray, RayTaskRunner(address=config.cluster.address, init_kwargs=init_kwargs())


def _announce(ray, config: PipelineConfig, stage: str, count: int, cpus: float, gpus: float) -> None:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    get_run_logger().info(
        "%s: %d shard task(s) on the Ray cluster at %s (%d live nodes), each asking for %g CPU, %g GPU",
        stage,
        count,
        config.cluster.address,
        len(nodes),
        cpus,
        gpus,
    )


def _collect(calls: Sequence[tuple[Task, tuple]], futures: list, retries: int) -> list:
    """Each task's result, or its error (Ray's word that a worker died as a ShardLost naming the task)."""
    outcomes = []
    for (task, _), future in zip(calls, futures, strict=True):
        try:
            outcomes.append(future.result())
        except Exception as exc:  # noqa: BLE001 -- returned; the caller decides what a failure means
            outcomes.append(_named(task.name, exc, retries))
    return outcomes


def _submit(runner, calls: Sequence[tuple[Task, tuple]]) -> list:
    return [runner.submit(task, get_call_parameters(task.fn, args, {})) for task, args in calls]


def run_shards(
    config: PipelineConfig,
    stage: str,
    calls: Sequence[tuple[Task, tuple]],
    cpus: float,
    gpus: float = 0.0,
) -> list:
    """Run ``task(*args)`` for each ``(task, args)`` on the cluster (name each task with
    ``with_options(name=...)``); results in call order, the first failure raised once all ended.
    Called inside the stage's flow."""
    from prefect_ray.context import remote_options

    ray, runner = _runner(config, stage, cpus, gpus)
    _announce(ray, config, stage, len(calls), cpus, gpus)
    with runner, remote_options(**_options(config, cpus, gpus)):
        futures = _submit(runner, calls)
        for done, future in enumerate(futures):
            report(stage, "on the cluster", done, len(futures), unit="shards")
            future.wait()
    report(stage, "on the cluster", len(futures), len(futures), unit="shards")
    outcomes = _collect(calls, futures, config.cluster.task_max_retries)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    for error in failed[1:]:
        get_run_logger().error("%s", error)
    if failed:
        raise failed[0]
    return outcomes


async def run_shards_async(
    config: PipelineConfig,
    stage: str,
    calls: Sequence[tuple[Task, tuple]],
    cpus: float,
) -> list:
    """``run_shards`` for async tasks inside an async flow (generation): the waits run in threads, so
    the flow's event loop keeps serving (the managed server's watch). Returns every outcome, errors
    included, as ``asyncio.gather(..., return_exceptions=True)`` does."""
    import asyncio

    from prefect_ray.context import remote_options

    ray, runner = _runner(config, stage, cpus, 0.0)
    _announce(ray, config, stage, len(calls), cpus, 0.0)
    with runner:
        with remote_options(**_options(config, cpus, 0.0)):
            futures = _submit(runner, calls)
        try:
            await asyncio.gather(*(asyncio.to_thread(f.wait) for f in futures))
        except asyncio.CancelledError:  # the flow gave up (its server is gone for good): so do the tasks
            for future in futures:
                ray.cancel(future.wrapped_future, force=True)
            raise
    return await asyncio.to_thread(_collect, calls, futures, config.cluster.task_max_retries)


def _named(name: str, exc: Exception, retries: int) -> BaseException:
    """The task's own error as raised; Ray's word that its worker died, as one line naming the task."""
    module = type(exc).__module__ or ""
    if module.startswith("ray."):
        return ShardLost(
            f"{name}: its Ray worker died {retries + 1} time(s) (cluster.task_max_retries={retries}); the shard's "
            f"finished part is on disk and a rerun resumes it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        )
    return exc
