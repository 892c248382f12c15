"""Which task failures a Prefect retry can fix.

Tasks that resume (tokenize and extract shards, training) retry once, which covers a crashed
worker or a killed torchrun. A retry cannot fix bad input, a config error, a tokenizer that
changed, a full disk or a refused deletion: it would fail the same way seconds later and put a
second failed attempt in the UI. Those errors end the task at once; the fix is the user's, and
the rerun after it resumes.

Classes are named, not imported, so this module loads without torch or the stage modules.
"""

from __future__ import annotations

PERMANENT = frozenset(
    {
        "eagle3.config.base.ConfigError",
        "eagle3.durable.DiskWriteError",
        "eagle3.durable.UnsafeDeleteError",
        "eagle3.schemas.SchemaError",
        "eagle3.schemas.TokenizerMismatchError",
        "eagle3.manifest.AccountingError",
        "eagle3.models.ModelNotFoundError",
        "eagle3.generate.records.RecordFileError",
        "eagle3.tokenize.stage.TokenizeInputError",
        "eagle3.extract.errors.ExtractInputError",
        "eagle3.extract.errors.DiskSpaceError",
        "eagle3.extract.errors.LayerIdError",
        "eagle3.extract.errors.StatesError",
        "eagle3.train.stage.TrainInputError",
        "eagle3.train.stage.TrainDataError",
        "eagle3.train.target.TargetWeightsError",
    }
)


def is_permanent(exc: BaseException) -> bool:
    return any(f"{cls.__module__}.{cls.__qualname__}" in PERMANENT for cls in type(exc).__mro__)


def unless_permanent(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the task raised one of ``PERMANENT``."""
    exc = state.data if isinstance(getattr(state, "data", None), BaseException) else None
    return exc is None or not is_permanent(exc)
