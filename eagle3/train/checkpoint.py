"""A training checkpoint's files as data: the optimizer state's format, a tensors-only load of it, and a
serialiser's failed write told apart from a bug. The trainer (trainer.py) writes and reads them."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import torch


def optimizer_format(opt_state: dict) -> str:
    """ "fqn" for the state-dict API's full optimizer state (keyed by parameter names, what FSDP saves),
    "index" for torch.optim's own (keyed by position, what one process and DDP save)."""
    keys = [k for group in opt_state.get("param_groups", []) for k in group.get("params", [])]
    return "fqn" if keys and all(isinstance(k, str) for k in keys) else "index"


def load_tensors_only(path: Path, device) -> dict:
    """torch.load restricted to tensors, numbers and containers: a checkpoint in a run directory is
    data, and a pickle that names any other object is refused rather than run."""
    import pickle

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{path}: refusing to load, it holds more than tensors and numbers ({first}); "
            "delete this checkpoint folder to resume from an earlier one, or the checkpoints folder to start over"
        ) from None


# Native serialisers report a failed write as their own error type (measured on a full tmpfs):
# safetensors as SafetensorError("Error while serializing: I/O error: No space left on device (os
# error 28)"), torch as RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576
# vs 534") for a short write, or "... file write failed".
IO_FAILURE = re.compile(
    r"I/O error|IoError|os error \d+|unexpected pos \d+ vs \d+|file write failed|No space left|quota exceeded",
    re.IGNORECASE,
)


def as_os_error(exc: Exception) -> OSError | None:
    """``exc`` as the OSError it stands for when it is a failed write, else None (a real bug stays itself)."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    if not IO_FAILURE.search(text):
        return None
    code = re.search(r"(?:os error|code:) (\d+)", text)
    number = int(code.group(1)) if code else errno.EIO
    return OSError(number, f"{os.strerror(number)} ({text.strip().splitlines()[0][:200]})")


def check_global_batch(path: Path, state: dict, world: int, grad_accum: int, batch_tokens: int) -> None:
    """A resumed run takes the optimizer steps of the run that wrote the checkpoint only at the same
    global batch: as many micro-batches per step (processes x train.grad_accum), each of the same
    train.batch_tokens. Processes and grad_accum may trade (2 x 6 resumes on 4 x 3 or on 3 x 4: the
    same steps, the same curve); anything else would renumber the steps, move the schedule and skip or
    repeat samples, so it is refused naming both. A checkpoint written before these were recorded
    (no ``grad_accum`` in its trainer_state.json) is not checked."""
    if "grad_accum" not in state:
        return
    was_world, was_accum, was_tokens = int(state["world_size"]), int(state["grad_accum"]), int(state["batch_tokens"])
    if was_world * was_accum == world * grad_accum and was_tokens == batch_tokens:
        return
    raise ValueError(
        f"{path}: written at a global batch of {was_world * was_accum} micro-batches of train.batch_tokens="
        f"{was_tokens} per optimizer step ({was_world} process(es) x train.grad_accum={was_accum}), this run takes "
        f"{world * grad_accum} of train.batch_tokens={batch_tokens} ({world} process(es) x train.grad_accum="
        f"{grad_accum}); resume with processes x grad_accum = {was_world * was_accum} and train.batch_tokens = "
        f"{was_tokens}, or delete the checkpoints folder to start over"
    )
