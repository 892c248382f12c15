"""Progress artifacts that never stop the work they show (docs/faults.md#orchestrator-loss).

A progress bar in the Prefect UI is for the person watching; the shard's truth is on disk. While the
Prefect server is away each artifact call waits out the client's retry window (cli/prefect_client.py)
and then raises. Raised inside a shard task, that error would fail a shard whose own work is fine and
start a task retry that waits the window again. So a failed create or update logs one warning and the
work goes on; a task whose bar could not be created updates nothing.

Only the Prefect API's own failures are caught (httpx errors: transport errors and error statuses);
anything else is a bug and raises.
"""

from __future__ import annotations

from uuid import UUID

import httpx
from prefect.artifacts import (
    acreate_progress_artifact,
    aupdate_progress_artifact,
    create_progress_artifact,
    update_progress_artifact,
)


def _warn(logger, what: str, exc: Exception) -> None:
    logger.warning(
        "%s: the Prefect API did not take it (%s: %s); the work goes on without it", what, type(exc).__name__, exc
    )


def start(description: str, logger) -> UUID | None:
    """A new progress artifact at 0 %, or None when the API did not answer."""
    try:
        return create_progress_artifact(progress=0.0, description=description)
    except httpx.HTTPError as exc:
        _warn(logger, f"progress artifact '{description}'", exc)
        return None


def update(artifact: UUID | None, percent: float, logger) -> None:
    if artifact is None:
        return
    try:
        update_progress_artifact(artifact, percent)
    except httpx.HTTPError as exc:
        _warn(logger, f"progress update to {percent:.0f} %", exc)


async def astart(description: str, logger) -> UUID | None:
    try:
        return await acreate_progress_artifact(progress=0.0, description=description)
    except httpx.HTTPError as exc:
        _warn(logger, f"progress artifact '{description}'", exc)
        return None


async def aupdate(artifact: UUID | None, percent: float, logger) -> None:
    if artifact is None:
        return
    try:
        await aupdate_progress_artifact(artifact, percent)
    except httpx.HTTPError as exc:
        _warn(logger, f"progress update to {percent:.0f} %", exc)
