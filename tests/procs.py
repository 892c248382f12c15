"""Which processes on the machine are this test worker's own.

Tests that look for leftovers (a vLLM server, a replica actor, a torchrun) scan the process table; with
two pytest-xdist workers the other worker's tests run servers of their own at the same time. Every
process a test starts inherits the worker's PYTEST_XDIST_WORKER (tests/conftest.py), so a scan keeps
the processes whose environment carries this worker's name. Outside xdist every process counts, as
before. ``marked`` narrows that to what one command started, by a variable the test put in its
environment.
"""

from __future__ import annotations

import os

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


def marked(mark: str) -> dict[int, str]:
    """Live processes (not zombies) of this worker whose environment holds ``mark`` ("NAME=VALUE", set
    in the environment of a command a test starts, so every process the command starts inherits it):
    pid -> command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not ours(entry):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if mark.encode() not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                found[int(entry)] = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile
    return found
