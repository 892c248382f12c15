"""Shard tasks on the Ray cluster that ``[cluster]`` names, through prefect-ray's task runner.

A stage placed on the cluster hands its shard tasks to prefect-ray's ``RayTaskRunner`` inside the
stage's own flow run (not a nested flow: a subflow costs a second of Prefect's bookkeeping per
stage, measured in benchmarks/README.md): each task is a Ray task asking for the stage's
resources (``cluster.<stage>_cpus`` / ``_gpus``) and runs the same Prefect task as on one machine,
so its logs, retries, markers and accounting are unchanged and it shows in the UI under the stage's
flow run as today. Ray reruns a task whose worker or node died (``cluster.task_max_retries``); the shard's
disk markers make the rerun redo only what that shard had not finished. Every shard is waited for
before the first failure is raised, so the shards that could finish are on disk for the resume; the
wait ends for a shard no live node can run any more (its node lost) after ``cluster.node_wait_s``
(``eagle3.cluster.wait_for_tasks``), and the failure counts the shards lost.

Imported only when an address is set: the stage flows import this module inside the branch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prefect import get_run_logger
from prefect.tasks import Task
from prefect.utilities.callables import get_call_parameters

from eagle3.cluster import wait_for_tasks
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


def _collect(config: PipelineConfig, calls: Sequence[tuple[Task, tuple]], futures: list, homeless: set[int]) -> list:
    """Each task's result, or its error (Ray's word that a worker died as a ShardLost naming the task;
    a task cancelled because no live node could run it, as a ShardLost saying so)."""
    outcomes = []
    for index, ((task, _), future) in enumerate(zip(calls, futures, strict=True)):
        if index in homeless:
            outcomes.append(
                ShardLost(
                    f"{task.name}: no live node of the cluster could run it for cluster.node_wait_s="
                    f"{config.cluster.node_wait_s:g} s (the node(s) that could were lost), so it was cancelled; the "
                    "shard's finished part is on disk and a rerun resumes it once such a node is back"
                )
            )
            continue
        try:
            outcomes.append(future.result())
        except Exception as exc:  # noqa: BLE001 -- returned; the caller decides what a failure means
            outcomes.append(_named(task.name, exc, config.cluster.task_max_retries))
    return outcomes


def _wait(
    ray, config: PipelineConfig, stage: str, futures: list, asked: dict[str, float], progress: bool = True
) -> set[int]:
    """Wait for every shard task under the lost-node deadline (with ``progress``, counting the shards
    that ended on the progress board); returns the indices of the tasks cancelled because no live
    node could run them."""
    done = [0]

    def ended(index: int) -> None:
        futures[index].wait()  # its final state, read while the result is at hand
        done[0] += 1
        if progress:
            report(stage, "on the cluster", done[0], len(futures), unit="shards")

    if progress:
        report(stage, "on the cluster", 0, len(futures), unit="shards")
    refs = [f.wrapped_future for f in futures]
    return wait_for_tasks(ray, refs, asked, config.cluster.node_wait_s, on_done=ended)


def _raise_first(stage: str, outcomes: list) -> None:
    """Log a count of the shards that did not finish and every failure but the first, then raise the
    first: a task's own error as raised (its retry policy decides), else one ShardLost counting them."""
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if not failed:
        return
    lost = [o for o in failed if isinstance(o, ShardLost)]
    logger = get_run_logger()
    logger.error(
        "%s: %d of %d shard task(s) did not finish on the cluster (%d lost with their worker or node, %d failed); "
        "%d finished and are on disk",
        stage,
        len(failed),
        len(outcomes),
        len(lost),
        len(failed) - len(lost),
        len(outcomes) - len(failed),
    )
    own = [o for o in failed if not isinstance(o, ShardLost)]
    if own:
        for error in failed:
            if error is not own[0]:
                logger.error("%s", error)
        raise own[0]
    raise ShardLost(
        f"{stage}: {len(lost)} of {len(outcomes)} shard task(s) lost on the cluster, {len(outcomes) - len(lost)} "
        "finished and on disk; a rerun resumes the rest. " + "; ".join(str(e) for e in lost)
    )


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
    ``with_options(name=...)``); results in call order. Once all ended, a failure is raised: a task's
    own error as it was raised, else one ShardLost counting the shards lost. Called inside the stage's flow."""
    from prefect_ray.context import remote_options

    ray, runner = _runner(config, stage, cpus, gpus)
    _announce(ray, config, stage, len(calls), cpus, gpus)
    with runner, remote_options(**_options(config, cpus, gpus)):
        futures = _submit(runner, calls)
        homeless = _wait(ray, config, stage, futures, {"CPU": cpus, "GPU": gpus})
    outcomes = _collect(config, calls, futures, homeless)
    _raise_first(stage, outcomes)
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
            homeless = await asyncio.to_thread(_wait, ray, config, stage, futures, {"CPU": cpus}, False)
        except asyncio.CancelledError:  # the flow gave up (its server is gone for good): so do the tasks
            for future in futures:
                ray.cancel(future.wrapped_future, force=True)
            raise
    return await asyncio.to_thread(_collect, config, calls, futures, homeless)


def _named(name: str, exc: Exception, retries: int) -> BaseException:
    """The task's own error as raised; Ray's word that its worker or node died, as one line naming the
    task (Ray's class says which: WorkerCrashedError, NodeDiedError)."""
    module = type(exc).__module__ or ""
    if module.startswith("ray."):
        return ShardLost(
            f"{name}: its Ray worker or node died {retries + 1} time(s) (cluster.task_max_retries={retries}); the "
            f"shard's finished part is on disk and a rerun resumes it ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]})"
        )
    return exc
