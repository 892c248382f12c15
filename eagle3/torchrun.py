"""torchrun's environment: the same on one machine (eagle3/train/stage.py) and on every cluster node
(eagle3/cluster/train.py), so a job resumed elsewhere repeats the same arithmetic. Training talks to
no service, so it inherits no credential (eagle3/secret_env.py)."""

from __future__ import annotations

from collections.abc import Iterable

from eagle3.secret_env import child_env


def torchrun_env(threads: int, base: dict | None = None, drop: Iterable[str] = ()) -> dict[str, str]:
    """torchrun's environment: ``base`` (default: this process's) less its credentials (secret_env's
    and the names in ``drop``), with unbuffered output and ``threads`` OpenMP threads per process
    unless ``base`` sets them."""
    base = child_env(base, drop=drop)
    env = {**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", str(threads))}
    # MKL's reproducibility conditions: a fixed thread count, not one it may lower at run time, so
    # that a resumed run repeats the uninterrupted run's CPU arithmetic (an environment setting wins).
    for name in ("MKL_DYNAMIC", "OMP_DYNAMIC"):
        env.setdefault(name, "FALSE")
    return env
