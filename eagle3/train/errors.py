"""Errors of stage ``train`` a user can act on (no torch import: the CLI and the stage module load this;
the training workers raise them from eagle3/train/data.py, which the stage module never imports)."""

from __future__ import annotations

from eagle3.errors import InputError, MissingInputError

# Training inputs missing, or not what this config needs (the stage that writes them must run again).
TrainInputError = MissingInputError


class TrainDataError(InputError, ValueError):
    """Training inputs that do not line up (names the file and what differs)."""
