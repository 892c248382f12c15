"""The temporary Prefect server of an ``eagle3`` command run without ``PREFECT_API_URL``.

Prefect 3 starts one by itself when a flow runs with no API URL (``SubprocessASGIServer`` in
prefect/server/api/server.py): uvicorn serving ``prefect.server.api.server:create_app`` as a plain
child in the command's own process group, stopped only by an ``atexit`` hook. No ``atexit`` hook runs
after a SIGKILL, nor after a SIGTERM: Prefect's flow engine turns a SIGTERM into its
``TerminationSignal``, records the crash, then puts the handler it found back (by default SIG_DFL)
and sends SIGTERM again, which ends the process on the spot. Either way the server was left running,
its parent gone.

So the command starts that server itself, the way Prefect does (the same uvicorn command and the same
settings, so the same start, ~12 s on 2 cores), as an ``eagle3.proc.Child``: a session of its own
(a terminal's Ctrl-C reaches the command alone, which stops the server last), a guard process that
stops it when the command dies however it dies, and a stop when the command ends. ``PREFECT_API_URL``
then points every Prefect client of the command, and what it starts, at it, so Prefect never starts
its own. The start overlaps what the command does before its first flow run (``ready`` waits).
No pidfile: a guard killed together with the command is the one case left, and a leftover
Prefect server holds no GPU and writes nothing of the run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3.errors import TransientError
from eagle3.proc import Child
from eagle3.secret_env import SECRET_ENV, child_env

logger = logging.getLogger("eagle3.prefect_server")

# SIGTERM to SIGKILL, as Prefect's own stop of this server (uvicorn finishes its requests and the
# server's services in well under a second here).
STOP_GRACE_S = 5.0
# The start's deadline when PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is not set (Prefect's default).
DEFAULT_STARTUP_S = 20.0
# A port that was free when chosen can be taken before uvicorn binds it: then a new one, this many times.
START_TRIES = 3
# How long the end of a command waits for Prefect's log and event workers to send what they hold.
DRAIN_S = 5.0
# Settings Prefect's own temporary server runs with: no UI, and the app built as an ephemeral server's.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# The server is Prefect: it keeps Prefect's settings, credentials included (a server credential set in
# this environment is its own; its database URL too), and none of the pipeline's other credentials.
PREFECT_SECRETS = frozenset(name for name in SECRET_ENV if name.startswith("PREFECT_"))


class PrefectServerError(TransientError):
    """The temporary Prefect server did not come up."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(port: int) -> list[str]:
    site = Path(importlib.util.find_spec("prefect").origin).parent.parent
    return [
        *(sys.executable, "-m", "uvicorn", "--app-dir", str(site)),
        *("--factory", "prefect.server.api.server:create_app"),
        *("--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"),
    ]


def _point_prefect_at(env: dict[str, str | None]) -> None:
    """Set (or, for None values, drop) Prefect's settings in this process's environment and make Prefect,
    which read its settings when first imported, read them again."""
    from prefect.context import refresh_global_settings_context

    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    refresh_global_settings_context()


class TemporaryServer:
    """One temporary Prefect server: ``start()`` returns at once and points this process's Prefect at it,
    ``ready()`` waits for /api/health. ``drop_env``: names the server must not inherit besides the
    pipeline's credentials (the config's server.api_key_env)."""

    def __init__(self, drop_env: tuple[str, ...] = ()) -> None:
        self.child: Child | None = None
        self.port = 0
        self.drop_env = drop_env

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> TemporaryServer:
        self.port = _free_port()
        inherited = child_env(drop=self.drop_env, keep=PREFECT_SECRETS)
        env = {k: v for k, v in inherited.items() if k != "PREFECT_API_URL"} | SERVER_ENV
        self.child = Child(
            _argv(self.port),
            name="temporary Prefect server",
            logger=logger,
            env=env,
            grace_s=STOP_GRACE_S,
            level_of=lambda _line: logging.WARNING,  # run with --log-level error: every line it writes matters
        ).start()
        _point_prefect_at({"PREFECT_API_URL": self.api_url})
        return self

    def ready(self) -> None:
        """Wait until the server answers /api/health; a server that exited at start (its port taken
        meanwhile) is started again on another port. PrefectServerError past the deadline."""
        import httpx

        timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", DEFAULT_STARTUP_S))
        deadline, tries = time.monotonic() + timeout_s, 1
        while time.monotonic() < deadline:
            if self.child.poll() is not None:
                if tries >= START_TRIES:
                    break
                self.child.stop()
                self.start()
                tries += 1
                continue
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.api_url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.1)
        code = self.child.poll()
        self.stop()
        why = f"exited with code {code}" if code is not None else f"did not answer within {timeout_s:g} s"
        raise PrefectServerError(
            f"the temporary Prefect server {why} (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS sets the wait; "
            f"set PREFECT_API_URL to use a running server instead); its last lines: {' | '.join(self.child.tail())}"
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


def _drain_prefect_workers() -> None:
    """Send what Prefect's log and event workers still hold, before their server goes (as
    prefect_test_harness does): at interpreter exit they would find it gone."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(RuntimeError):  # never started in this process
            worker.drain_all(timeout=DRAIN_S, at_exit=False)


@contextlib.contextmanager
def for_this_command(flow, drop_env: tuple[str, ...] = ()) -> Iterator[TemporaryServer | None]:
    """A temporary server for the block, and PREFECT_API_URL pointing at it, when ``flow`` (what the
    command runs) is a Prefect flow and no Prefect API URL is configured (environment or profile);
    otherwise nothing (None; a test's stand-in for a flow needs no server, and with
    PREFECT_SERVER_EPHEMERAL_ENABLED=false Prefect says that an API URL is missing, as it would).
    Call ``ready()`` before the flow runs. ``drop_env``: see TemporaryServer."""
    from prefect import Flow
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if not isinstance(flow, Flow) or settings.api.url or not settings.server.ephemeral.enabled:
        yield None
        return
    # It serves no UI (nor does Prefect's own): an empty UI URL keeps Prefect from logging links to one.
    added = ["PREFECT_API_URL"] + ([] if "PREFECT_UI_URL" in os.environ else ["PREFECT_UI_URL"])
    os.environ.setdefault("PREFECT_UI_URL", "")
    server = TemporaryServer(drop_env).start()
    try:
        yield server
    except Exception:
        _drain_prefect_workers()  # a failed run's logs matter most; a stop (KeyboardInterrupt) does not wait
        raise
    else:
        _drain_prefect_workers()
    finally:
        _point_prefect_at(dict.fromkeys(added))
        server.stop()
