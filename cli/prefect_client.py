"""How long a run waits for a Prefect server that went away, and what it says when it gives up.

The decision (docs/faults.md#orchestrator-loss): a run rides out a restart of its Prefect server, or of
the server's database, that lasts less than the client's retry window, and stops when the outage is
longer; the next trigger resumes from the disk markers. Nothing of a stage's own work needs the server
(records, markers and the manifest are files), so an outage only delays the calls that record states,
logs and artifacts; it is Prefect's HTTP client that waits, retrying each call. Its settings are
written here, not left to Prefect's defaults, and the same values go wherever a flow runs without this
command: docker/worker.Dockerfile, scripts/ui.sh and the deployments' ``work_pool.job_variables.env``
(tests/unit/test_prefect_client.py keeps them equal).

Facts of Prefect 3.9 this rests on (prefect/client/base.py, ``PrefectHttpxAsyncClient.send`` and
``_send_with_retry``; the sync client is the same):
- a call is retried on a refused connection (once the client has connected before), a dropped or
  timed-out one, and on the status codes 408, 429, 502, 503 plus ``PREFECT_CLIENT_RETRY_EXTRA_CODES``;
- the k-th wait is ``2**k`` seconds, jittered by ``PREFECT_CLIENT_RETRY_JITTER_FACTOR``
  (``clamped_poisson_interval``: between 0.82x and 1.2x for 0.2), for ``PREFECT_CLIENT_MAX_RETRIES`` waits;
  then the call raises and the task or flow that made it fails.
"""

from __future__ import annotations

import math
import os
import sys

# 6 retries: waits of 2, 4, ..., 64 s, 126 s nominal. A server process restarted in place answers again
# in 8-25 s here (SIGKILL to /api/health, 2 loaded cores), a pod rescheduled onto a node that has the
# image in well under a minute; 6 covers both with room. A 7th would double the window (254 s) and make a
# call that is waiting when the server returns wait up to 128 s more; a longer outage (an upgrade with
# migrations, a lost database) stops the run instead, and the rerun resumes it.
MAX_RETRIES = 6
# Prefect's own jitter, written down: several workers and flow runs retrying in step would meet the
# restarted server all at once.
JITTER_FACTOR = 0.2
# 500: a Postgres-backed Prefect 3.9 server whose database is down answers 500 (asyncpg's refused
# connection is not among the errors prefect/server/api/server.py:is_client_retryable_exception turns
# into 503), so without it one call during a database restart fails the run at once. The cost: a server
# bug's 500 is retried for the window before the run fails.
EXTRA_CODES = "500"
# Prefect's default, written down: the API answers in milliseconds; this bounds a call to a server that
# accepts connections but hangs (stalled on its database). Each such attempt can take this long.
REQUEST_TIMEOUT_S = 60

CLIENT_SETTINGS = {
    "PREFECT_CLIENT_MAX_RETRIES": str(MAX_RETRIES),
    "PREFECT_CLIENT_RETRY_JITTER_FACTOR": str(JITTER_FACTOR),
    "PREFECT_CLIENT_RETRY_EXTRA_CODES": EXTRA_CODES,
    "PREFECT_API_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S),
}
HOWTO = "docs/faults.md#orchestrator-loss"


def apply() -> None:
    """Set the client settings unless the environment sets them; before Prefect is imported (it reads
    its settings once)."""
    for name, value in CLIENT_SETTINGS.items():
        os.environ.setdefault(name, value)


def window_s(max_retries: int | None = None, jitter: float | None = None) -> tuple[float, float]:
    """The shortest and longest time a refused call is retried before it fails: the sum of the waits,
    each jittered between Prefect's lower clamp (``prefect.utilities.math.lower_clamp_multiple``) and
    ``1 + jitter`` times its nominal length. Read from the environment by default."""
    n = int(os.environ.get("PREFECT_CLIENT_MAX_RETRIES", MAX_RETRIES)) if max_retries is None else max_retries
    j = float(os.environ.get("PREFECT_CLIENT_RETRY_JITTER_FACTOR", JITTER_FACTOR)) if jitter is None else jitter
    nominal = float(sum(2**k for k in range(1, n + 1)))
    if j <= 0:
        return nominal, nominal
    upper = 1 + j
    lower = 0.0 if upper >= 50 else math.log(2**upper / (2**upper - 1), 2)
    return nominal * lower, nominal * upper


def lost_api(exc: BaseException) -> str | None:
    """One line for an error that means the Prefect API at PREFECT_API_URL stayed away past the window
    (a transport error or a 5xx on a call to it), else None."""
    import httpx

    api = _api_url().rstrip("/")
    for err in _chain(exc):
        if isinstance(err, httpx.HTTPStatusError) and err.response.status_code < 500:
            continue
        if not isinstance(err, (httpx.TransportError, httpx.HTTPStatusError)):
            continue
        try:
            url = str(err.request.url)
        except RuntimeError:  # an httpx error raised without its request
            continue
        if api and url.startswith(api):
            low, _ = window_s()
            retries = os.environ.get("PREFECT_CLIENT_MAX_RETRIES", MAX_RETRIES)
            what = (
                f"it answered {err.response.status_code}"
                if isinstance(err, httpx.HTTPStatusError)
                else f"no answer: {type(err).__name__}"
            )
            return (
                f"lost the Prefect server at PREFECT_API_URL={api} ({what}; a refused call is retried for at least "
                f"{math.floor(low)} s, PREFECT_CLIENT_MAX_RETRIES={retries}). The run stopped; what it finished is on "
                f"disk: run the same command again to resume ({HOWTO})"
            )
    return None


def _api_url() -> str:
    """PREFECT_API_URL from the environment, else from the active Prefect profile once Prefect is loaded."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if "prefect" not in sys.modules:
        return ""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or ""


def _chain(exc: BaseException):
    """The error and its causes and contexts, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__, *getattr(err, "exceptions", ())]
