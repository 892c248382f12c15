"""Errors of stage ``extract`` a user can act on (no torch import: the CLI loads this)."""

from __future__ import annotations


class ExtractInputError(RuntimeError):
    """The stage's inputs are missing, incomplete or inconsistent."""


class DiskSpaceError(RuntimeError):
    """Not enough free disk for the states this run would store."""


class LayerIdError(ValueError):
    """Layer ids that do not fit the target."""


class StatesError(ValueError):
    """States that cannot be written or read as promised (shape, finiteness, completeness)."""


USER_ERRORS = (ExtractInputError, DiskSpaceError, LayerIdError, StatesError)
