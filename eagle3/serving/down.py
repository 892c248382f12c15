"""Which servers this process knows to be down, told by whoever watches them.

A managed vLLM server's supervisor (eagle3/serving/managed.py) sees its process exit before any
request does. It writes the server's base URL here, with why, for as long as its restart takes;
an EndpointPool in the same process (the shard tasks of a local run, which share the flow's
process) benches that replica at its next request instead of learning of the death from a
refused or dropped request -- so no request is sent to a dead server, and a kill that lands
when the replica holds a single request is still seen as the outage it is. The pool's probe of
``/v1/models`` stays the only way back into use. Pools in other processes (Ray workers) never
see these marks and learn from failures, as before.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_down: dict[str, str] = {}


def _key(base_url: str) -> str:
    return base_url.rstrip("/")


def mark_down(base_url: str, why: str) -> None:
    with _lock:
        _down[_key(base_url)] = why


def mark_up(base_url: str) -> None:
    with _lock:
        _down.pop(_key(base_url), None)


def why_down(base_url: str) -> str | None:
    """Why the server at ``base_url`` is known to be down, or None."""
    return _down.get(_key(base_url))


def any_down() -> bool:
    return bool(_down)
