"""Where a secret must not be (issue 29, "credentials out of sight"): each function returns the
places, by name, whose contents hold ``secret``; an empty list means it is nowhere there.

- ``ray_metadata``: Ray's own records in the GCS, read raw (every byte of the protobufs, so a field
  this scan does not know by name is searched too): the job table with its submission info, the actor
  table, every task's events (a task's runtime_env is there) and the worker table.
- ``prefect_records``: what the Prefect API holds for a flow run: its parameters and the rest of the
  flow run, its task runs, its logs and its artifacts.
- ``files``: every file under some folders (a run folder, Ray's session logs).
- ``process_environments``: the environment of some processes and all their descendants (a Ray node's
  launcher, its raylet and the workers the raylet forks).
"""

from __future__ import annotations

import os
from pathlib import Path


def ray_metadata(address: str, secret: str) -> list[str]:
    """Joins the cluster at ``address`` as a driver when not joined already (call ``ray.shutdown()``)."""
    import ray
    from ray._private.state import state

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    accessor = state._connect_and_get_accessor()
    tables = {
        "job table": accessor.get_job_table(skip_submission_job_info_field=False, skip_is_running_tasks_field=True),
        "actor table": accessor.get_actor_table(None, None),
        "task events": accessor.get_task_events(),
        "worker table": accessor.get_worker_table(),
    }
    assert tables["job table"] and tables["task events"], "Ray's tables are empty: the scan would prove nothing"
    needle = secret.encode()
    return [f"{name} entry {i}" for name, rows in tables.items() for i, row in enumerate(rows) if needle in row]


def prefect_records(flow_run_id, secret: str) -> list[str]:
    """The flow run (its parameters included), its task runs, logs and artifacts, as the API returns them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
    )

    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        records = {"flow run": [flow_run], "flow run parameters": [flow_run.parameters]}
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        records["task runs"] = client.read_task_runs(flow_run_filter=this_run)
        records["logs"] = client.read_logs(LogFilter(flow_run_id={"any_": [flow_run_id]}))
        records["artifacts"] = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    assert records["task runs"] and records["logs"], "the flow run left no records: the scan would prove nothing"
    found = []
    for name, items in records.items():
        for item in items:
            text = item.model_dump_json() if hasattr(item, "model_dump_json") else repr(item)
            if secret in text:
                found.append(f"{name}: {text[:200]}")
    return found


def files(folders: list[Path], secret: str) -> list[str]:
    needle = secret.encode()
    found, seen = [], 0
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file() and not path.is_symlink():
                seen += 1
                try:
                    if needle in path.read_bytes():
                        found.append(str(path))
                except OSError:  # a socket or a file gone meanwhile
                    continue
    assert seen, f"no file under {folders}: the scan would prove nothing"
    return found


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # after the name: state, ppid
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
    return parents


def process_environments(roots: list[int], secret: str) -> list[str]:
    """Every readable /proc/PID/environ of ``roots`` and their descendants (a Ray node's launcher: its
    raylet, the workers the raylet forks, its agents)."""
    parents = _parents()
    tree, grew = set(roots), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    needle = secret.encode()
    found, seen = [], 0
    for pid in sorted(tree):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        seen += 1
        if needle in environ:
            found.append(f"pid {pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
    assert seen > len(roots), f"no process under {roots}: the scan would prove nothing"
    return found
