"""The pipeline's error hierarchy: what a person must fix, and whether a retry can help.

Every error the pipeline raises on purpose derives from ``Eagle3Error``; its message is meant for the
person running the pipeline and names the file, row, key or limit involved. Anything else that escapes
is a bug and keeps its traceback.

Two questions, two axes:
- Can a retry fix it? ``TransientError`` (a crashed worker, a server that died, a deadline passed: the
  rerun resumes) or ``PermanentError`` (it would fail the same way seconds later). The Prefect retry
  policy (``tasks/retry.py``) reads ``is_permanent``; ``transient`` is the same answer as an attribute,
  per instance where one class holds both kinds (a request failure of the generation client).
- Whose fix is it? ``UserError``: the config, the input or the machine (free disk) must change.
  ``InputError``: a file, shard or row the stage reads is unusable. ``MissingInputError``: the one
  "an input is missing" error; it names the stage, the path and what to run first.

An error that modules of two packages raise lives here too, below both (``TrainFailed``: the train
stage and the cluster's training job; ``LayerIdError``: the run's facts, extraction and export).

No imports beyond the standard library: the CLI and ``tasks/`` load this without torch.
"""

from __future__ import annotations

from pathlib import Path


class Eagle3Error(Exception):
    """Base of every error the pipeline raises on purpose (one clear message, no traceback needed)."""

    transient: bool  # set by PermanentError / TransientError (or per instance)


class PermanentError(Eagle3Error):
    """A retry cannot fix it: the same inputs fail the same way."""

    transient = False


class TransientError(Eagle3Error):
    """A retry can fix it (a crash, a lost server, a deadline); the rerun resumes what was done."""

    transient = True


class UserError(PermanentError):
    """The person must change something: the config, the input, or the machine (free disk)."""


class InputError(UserError):
    """A file, shard or row the stage reads is unusable; the message names it."""


class MissingInputError(InputError):
    """An input a stage reads is missing, or is not the one this config needs.

    ``stage``: the stage that needs it; ``path``: the file, folder or config key; ``problem``: what is
    wrong with it (default "not found"); ``hint``: what to do, usually the command to run first.
    The arguments are kept as ``args`` so the error pickles (task results cross processes)."""

    def __init__(self, stage: str, path: str | Path, hint: str, problem: str = "not found"):
        super().__init__(stage, str(path), hint, problem)
        self.stage, self.path, self.hint, self.problem = stage, str(path), hint, problem

    def __str__(self) -> str:
        return f"{self.stage}: {self.path} {self.problem}: {self.hint}"


class LayerIdError(UserError, ValueError):
    """Layer ids that do not fit the target (extract.layer_ids, or a target too shallow for the defaults)."""


class TrainFailed(TransientError, RuntimeError):
    """torchrun exited with an error or ran past its deadline (on one machine or on the cluster)."""


def run_first(command: str, again: bool = False) -> str:
    """The hint of a MissingInputError whose fix is a command, e.g. run `eagle3 tokenize` first."""
    return f"run `{command}` {'again' if again else 'first'}"


def is_permanent(exc: BaseException) -> bool:
    """Whether a retry cannot fix ``exc``; errors outside the hierarchy (bugs, crashes) count as transient."""
    return isinstance(exc, Eagle3Error) and not getattr(exc, "transient", True)
