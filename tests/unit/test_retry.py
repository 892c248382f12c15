"""tasks/retry.py reads the error hierarchy (eagle3/errors.py): every error a retry cannot fix must
still be refused, and the predicate must tell them from errors a retry can fix."""

import importlib

import pytest

from tasks.retry import is_permanent, unless_permanent

# The errors the policy refused when it was a hand-kept list of names: each must stay permanent.
PERMANENT = frozenset(
    {
        "eagle3.config.ConfigError",
        "eagle3.durable.DiskWriteError",
        "eagle3.durable.UnsafeDeleteError",
        "eagle3.schemas.SchemaError",
        "eagle3.schemas.TokenizerMismatchError",
        "eagle3.results.AccountingError",
        "eagle3.models.ModelNotFoundError",
        "eagle3.records.RecordFileError",
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


@pytest.mark.parametrize("name", sorted(PERMANENT))
def test_each_permanent_name_is_a_real_exception_class(name):
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    assert isinstance(cls, type) and issubclass(cls, BaseException), name
    assert is_permanent(cls.__new__(cls))


def test_subclasses_count_and_other_errors_are_retried():
    from prefect.states import Completed, Failed

    from eagle3.durable import DiskWriteError
    from eagle3.schemas import SchemaError

    class SpecialSchemaError(SchemaError):
        pass

    assert is_permanent(SpecialSchemaError("x"))
    assert not unless_permanent(None, None, Failed(data=DiskWriteError(28, "full")))
    assert unless_permanent(None, None, Failed(data=RuntimeError("torchrun exited with code -9")))
    assert unless_permanent(None, None, Failed(data=TimeoutError()))
    assert unless_permanent(None, None, Completed())
