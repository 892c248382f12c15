"""Errors of stage ``extract`` a user can act on (no torch import: the CLI loads this)."""

from __future__ import annotations

from eagle3.errors import InputError, LayerIdError, MissingInputError, UserError

__all__ = ["DiskSpaceError", "ExtractInputError", "LayerIdError", "StatesError"]

# The stage's inputs (tokenized shards) are missing or not what the tokenize stage wrote.
ExtractInputError = MissingInputError


class DiskSpaceError(UserError, RuntimeError):
    """Not enough free disk for the states this run would store."""


class StatesError(InputError, ValueError):
    """States that cannot be written or read as promised (shape, finiteness, completeness)."""
