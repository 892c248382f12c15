"""Waiting for the Prefect API before a flow opens new clients (docs/faults.md#orchestrator-loss).

Prefect's client retries a call for the window cli/prefect_client.py sets, but a refused connection only
on a client that has connected before (prefect/client/base.py, ``PrefectHttpxAsyncClient.send``:
``_has_connected``). An async flow's own calls, and its async tasks', go through the flow's client,
connected when the run began, so a server restart mid-stage is ridden out. A sync subflow or a sync task
called from an async flow starts on fresh clients instead (``SyncClientContext.get_or_create``; a subflow's
parent task run is made by ``Task.create_run`` on a new client in Prefect's loop thread), and their first
call fails at once while the server is down. So before such a start an async flow reads its own flow run
through its own client (a read that needs the server's database too: a Postgres-backed server whose
database is down answers 500, which the window retries): during an outage that waits, retrying, until the
server answers or the window ends. (A server lost in the milliseconds between that answer and the start
still fails the run; the rerun resumes it.)
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext


async def api_answers() -> None:
    """Return once the Prefect API and its database answer; raise as the client does when the retry window
    ends first. Outside a flow run (a flow's ``.fn`` called directly) nothing starts a client: return at once."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    async with get_client() as client:
        await client.read_flow_run(context.flow_run.id)
