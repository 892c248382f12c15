"""Guard of one child process group: stops it when the pipeline process dies (see orphans.py).

Run as ``python -I -S guard.py PGID GRACE_S KILL_WAIT_S PARENT_PID [NOTE_FILE]`` with stdin =
the read end of a pipe only the parent holds open. EOF on stdin means the parent is gone,
however it died: SIGTERM the group, wait GRACE_S, SIGKILL the group and every descendant of
it (even one in another session), wait KILL_WAIT_S. While the parent
lives, poll once a second and exit as soon as the group is gone. Standard library only: it
starts in milliseconds and imports nothing of the project (``-S``: no site-packages).
"""

import os
import select
import signal
import sys
import time


def _table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, ppid, pgid, start ticks) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue  # exited while we looked
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    return table


def members(pgid: int) -> list[int]:
    """Live (not zombie) pids of the group; [] when it is gone."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        pass
    if not os.path.isdir("/proc"):
        return [pgid]
    return sorted(pid for pid, (state, _, group, _) in _table().items() if group == pgid and state != "Z")


def tree(pgid: int) -> dict[int, int]:
    """{pid: start ticks} of the group's live members and of all their descendants, wherever
    those run: torchrun starts each worker in a session of its own, and a worker whose agent was
    SIGKILLed is reparented away, so descendants are found while the group still stands."""
    if not os.path.isdir("/proc"):
        return {}
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, (_, _, group, _) in table.items() if group == pgid]
    found: dict[int, int] = {}
    seen = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if table[pid][0] != "Z":
            found[pid] = table[pid][3]
        todo += children.get(pid, [])
    return found


def _alive(known: dict[int, int]) -> list[int]:
    """Which of ``known`` still run as the same processes (same start time, not zombies)."""
    table = _table()
    return sorted(
        pid for pid, start in known.items() if pid in table and table[pid][3] == start and table[pid][0] != "Z"
    )


def stop_tree(pgid: int, grace_s: float, kill_wait_s: float, on_kill=None) -> list[int]:
    """SIGTERM the group (its leader shuts its own children down, as torchrun does), wait
    ``grace_s``; then SIGKILL the group and every descendant still running; wait
    ``kill_wait_s``. Returns the pids still alive at the end. ``on_kill(pids)`` is called
    before the SIGKILL, with what outlived the grace."""
    known = tree(pgid)
    left: list[int] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if sig == signal.SIGKILL and on_kill is not None:
            on_kill(left)
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            for pid in _alive(known):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait_s
        while True:
            known.update(tree(pgid))  # children started meanwhile
            left = sorted(set(members(pgid)) | set(_alive(known)))
            if not left:
                return []
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    return left


def say(note: str, text: str) -> None:
    if not note:
        return
    try:
        with open(note, "a") as fh:
            fh.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} eagle3 guard: {text}\n")
    except OSError:
        pass


def main(argv: list[str]) -> int:
    pgid, grace, kill_wait, parent = int(argv[1]), float(argv[2]), float(argv[3]), argv[4]
    note = argv[5] if len(argv) > 5 else ""
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if ready and os.read(0, 64) == b"":
            break  # the parent is gone
        if not members(pgid):
            return 0  # stopped normally
    alive = members(pgid)
    if not alive:
        return 0
    everyone = sorted(set(alive) | set(tree(pgid)))
    say(
        note,
        (
            f"the pipeline process {parent} is gone; stopping its process group {pgid} (pids {everyone}, with "
            f"descendants): SIGTERM, SIGKILL after {grace:g} s"
        ),
    )
    left = stop_tree(pgid, grace, kill_wait)
    say(note, f"process group {pgid} " + (f"still has pids {sorted(left)} after SIGKILL" if left else "stopped"))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
