"""Which task failures a Prefect retry can fix.

Tasks that resume (tokenize and extract shards, training) retry once, which covers a crashed
worker or a killed torchrun. A retry cannot fix bad input, a config error, a tokenizer that
changed, a full disk or a refused deletion: it would fail the same way seconds later and put a
second failed attempt in the UI. Those errors end the task at once; the fix is the user's, and
the rerun after it resumes.

The answer is the error's place in ``eagle3.errors`` (a ``PermanentError`` or a ``TransientError``);
that module is light, so this one still loads without torch or the stage modules.
"""

from __future__ import annotations

from eagle3.errors import is_permanent

__all__ = ["is_permanent", "unless_permanent"]


def unless_permanent(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the task raised a permanent error."""
    exc = state.data if isinstance(getattr(state, "data", None), BaseException) else None
    return exc is None or not is_permanent(exc)
