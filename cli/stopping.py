"""How an ``eagle3`` command stops on SIGTERM or SIGINT (docs/faults.md, "Stopping a run").

- The first SIGTERM or SIGINT becomes ``Stopped`` in the main thread, a KeyboardInterrupt, so the
  command unwinds as after Ctrl-C: each ``with`` or ``finally`` that started a vLLM server, torchrun
  or the temporary Prefect server stops it (SIGTERM to its group, then SIGKILL), and Prefect marks the
  flow runs Crashed. Then ``finish`` stops every group still running (``orphans.stop_all``: one started
  from a worker thread, which the exception does not reach), prints one line and exits 128 + the
  signal: 130 for SIGINT, 143 for SIGTERM.
- While a flow runs, Prefect's engine holds SIGTERM: its handler raises ``TerminationSignal``; the
  engine records the crash, puts our handler back and sends SIGTERM again, which reaches us. When the
  signal lands while the event loop waits, TerminationSignal leaves the loop instead (``run_async``
  notes it before the loop's tasks are cancelled). Either way it is this stop (``signal_of``).
- The grace period: GRACE_S after the signal a watchdog thread SIGKILLs every group still running and
  exits, whatever the main thread is doing (a server's own stop waiting out ``server.stop_grace_s``,
  worker threads the interpreter would wait for at exit).
- A second signal escalates: every group is SIGKILLed at once and the command exits.
- The command ends with ``os._exit``: a worker thread may still be inside a shard. What it wrote is
  as safe as after a SIGKILL (appends fsynced, whole files renamed into place; the kill matrix proves
  it) and the rerun resumes it.
No Prefect import here: TerminationSignal is recognised only once Prefect is loaded.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

from eagle3 import orphans

# From the signal to SIGKILL of whatever the command started and is still running, and to its exit.
# Why 15 s (vLLM's API server acts on SIGTERM only between its 10 s polls while its engine starts):
# docs/faults.md, "Stopping a run".
GRACE_S = 15.0
# After that SIGKILL, how long to wait for the kernel to take the processes down (a GPU context takes seconds).
KILL_WAIT_S = 5.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A signal that lands while a child is being started is sent again this much later (see _on_signal).
RETRY_S = 0.02


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread; ``signum`` is the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    def __init__(self) -> None:
        self.exiting = threading.Lock()  # one line, one exit, from whichever thread comes first
        self.signum: int | None = None
        self.deadline = 0.0
        self.command = ""
        self.argv: list[str] = []
        self.resumable = False


_state = _State()


@contextlib.contextmanager
def installed(command: str, argv: list[str], resumable: bool) -> Iterator[None]:
    """Stop the command the block runs (``command``: its name) on SIGTERM and SIGINT; ``argv`` (its
    arguments) goes into the closing line, which says how to resume when ``resumable``. The handlers
    found are put back at the end (a test calls ``main`` in its own process). Outside the main thread,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.command, _state.argv, _state.resumable = command, list(argv), resumable
    before = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _on_signal(signum: int, _frame) -> None:
    if _state.signum is None and orphans.is_starting():
        # A child is being spawned and guarded this instant: an exception now would orphan it. The same
        # signal again in a moment (milliseconds: a fork and exec) is this stop, not a second one.
        again = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    if begin(signum):
        raise Stopped(signum)
    if _state.exiting.locked():
        return  # the end is being written (handlers run in the main thread: it holds the lock, or nobody does)
    _exit(orphans.stop_all(0.0, KILL_WAIT_S), escalated=True)  # a second signal: no more grace


def begin(signum: int) -> bool:
    """Note a stop by ``signum`` and start the grace period; True the first time only. Called in the
    main thread only (signal handlers run there too), so a lock would only deadlock a handler."""
    if _state.signum is not None:
        return False
    _state.signum, _state.deadline = signum, time.monotonic() + GRACE_S
    threading.Thread(target=_watchdog, name="eagle3 stop watchdog", daemon=True).start()
    return True


def requested() -> int | None:
    """The signal that stops this command, once one came."""
    return _state.signum


def signal_of(exc: BaseException) -> int | None:
    """The stop signal behind ``exc``: a stop already under way explains any exception that follows it;
    else ``Stopped``, a KeyboardInterrupt (SIGINT) or Prefect's TerminationSignal; else None."""
    if _state.signum is not None:
        return _state.signum
    if isinstance(exc, Stopped):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    prefect_exceptions = sys.modules.get("prefect.exceptions")
    if prefect_exceptions is not None and isinstance(exc, prefect_exceptions.TerminationSignal):
        return exc.signal
    return None


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run``, but a stop signal that ends the event loop starts the grace period before the
    loop's tasks are cancelled and waited for (which stops the servers they started)."""
    import asyncio

    with asyncio.Runner() as runner:
        try:
            return runner.run(coro)
        except BaseException as exc:
            if (signum := signal_of(exc)) is not None:
                begin(signum)
            raise


def finish(signum: int) -> None:
    """The end of a stopped command: stop what still runs within what is left of the grace, say so in
    one line, exit 128 + ``signum``. Never returns."""
    try:
        begin(signum)  # a stop that reached us only as an exception starts its grace now
    except Stopped:
        pass  # the signal itself, landing inside begin: the same stop
    _exit(orphans.stop_all(max(0.0, _state.deadline - time.monotonic()), KILL_WAIT_S))


def _watchdog() -> None:
    time.sleep(max(0.0, _state.deadline - time.monotonic()))
    _exit(orphans.stop_all(0.0, KILL_WAIT_S), late=True)


def line(signum: int, left: list[int], *, escalated: bool = False, late: bool = False) -> str:
    """The one line a stopped command prints."""
    command = shlex.join(["eagle3", *_state.argv])
    name = signal.Signals(signum).name
    how = " (a second signal: SIGKILL at once)" if escalated else f" (SIGKILL after {GRACE_S:g} s)" if late else ""
    done = f"pids {left} survived SIGKILL" if left else "nothing it started is left running"
    resume = f"; to resume, run the same command: {command}" if _state.resumable else ""
    return f"eagle3 {_state.command}: stopped by {name}{how}, {done}{resume}"


def _exit(left: list[int], *, escalated: bool = False, late: bool = False) -> None:
    _state.exiting.acquire()  # held until os._exit: a second caller waits here for the end
    signum = _state.signum or signal.SIGTERM
    if threading.current_thread() is threading.main_thread():
        # Not from the watchdog: the main thread may hold a stream's lock, stuck in a write.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream; a flush re-entered from a handler
                stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, (line(signum, left, escalated=escalated, late=late) + "\n").encode())
    os._exit(128 + signum)
