"""Which processes on the machine are this test worker's own.

Tests that look for leftovers (a vLLM server, a replica actor, a torchrun) scan the process table; with
two pytest-xdist workers the other worker's tests run servers of their own at the same time. Every
process a test starts inherits the worker's PYTEST_XDIST_WORKER (tests/conftest.py), so a scan keeps
the processes whose environment carries this worker's name. Outside xdist every process counts, as
before.
"""

from __future__ import annotations

from conftest import WORKER


def ours(pid: int | str) -> bool:
    """True when ``pid`` belongs to this worker (always, without xdist); False when it is gone."""
    if not WORKER:
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return f"PYTEST_XDIST_WORKER={WORKER}".encode() in env
