"""Shard tasks on the Ray cluster that ``[cluster]`` names, through prefect-ray's task runner.

A stage placed on the cluster runs its shard tasks in a nested flow, ``eagle3-<stage>-on-ray``,
whose task runner is prefect-ray's ``RayTaskRunner``: each task is a Ray task asking for the
stage's resources (``cluster.<stage>_cpus`` / ``_gpus``) and runs the same Prefect task as on one
machine, so its logs, retries, markers and accounting are unchanged and it shows in the UI as
today. Ray reruns a task whose worker or node died (``cluster.task_max_retries``); the shard's
disk markers make the rerun redo only what that shard had not finished. Every shard is waited for
before the first failure is raised, so the shards that could finish are on disk for the resume.

Imported only when an address is set: the stage flows import this module inside the branch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from prefect import flow, get_run_logger
from prefect.tasks import Task

from eagle3.config import PipelineConfig
from eagle3.errors import TransientError


class ShardLost(TransientError, RuntimeError):
    """A shard task's worker died more often than cluster.task_max_retries allows."""


def run_shards(
    config: PipelineConfig,
    stage: str,
    task: Task,
    calls: Sequence[tuple[str, tuple]],
    cpus: float,
    gpus: float = 0.0,
) -> list:
    """Run ``task(*args)`` for each ``(task run name, args)`` on the cluster; results in call order."""
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    from eagle3.cluster import check_resources, connect, init_kwargs, workdir_env

    cluster = config.cluster
    ray = connect(cluster)
    check_resources(ray, stage, {"CPU": cpus, "GPU": gpus})
    options = {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "max_retries": cluster.task_max_retries,
        "runtime_env": workdir_env(os.getcwd()),
    }

    @flow(
        name=f"eagle3-{stage}-on-ray",
        description=f"The {stage} shard tasks placed on the Ray cluster at {cluster.address}.",
        task_runner=RayTaskRunner(address=cluster.address, init_kwargs=init_kwargs()),
    )
    def on_ray() -> list:
        log = get_run_logger()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        log.info(
            "%s: %d shard task(s) on the Ray cluster at %s (%d live nodes), each asking for %g CPU, %g GPU",
            stage,
            len(calls),
            cluster.address,
            len(nodes),
            cpus,
            gpus,
        )
        with remote_options(**options):
            futures = [task.with_options(name=name).submit(*args) for name, args in calls]
        for future in futures:
            future.wait()
        outcomes = []
        for (name, _), future in zip(calls, futures, strict=True):
            try:
                outcomes.append(future.result())
            except Exception as exc:  # noqa: BLE001 -- collected, the first raised below once all are counted
                outcomes.append(_named(name, exc, cluster.task_max_retries))
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            for error in failed[1:]:
                log.error("%s", error)
            raise failed[0]
        return outcomes

    return on_ray()


def _named(name: str, exc: Exception, retries: int) -> BaseException:
    """The task's own error as raised; Ray's word that its worker died, as one line naming the task."""
    module = type(exc).__module__ or ""
    if module.startswith("ray."):
        return ShardLost(
            f"{name}: its Ray worker died {retries + 1} time(s) (cluster.task_max_retries={retries}); the shard's "
            f"finished part is on disk and a rerun resumes it ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        )
    return exc
