"""tasks/retry.py names error classes as strings (so it loads without torch): each name must be a
real class, and the predicate must tell them from errors a retry can fix."""

import importlib

import pytest

from tasks.retry import PERMANENT, is_permanent, unless_permanent


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
