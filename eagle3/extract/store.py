"""Hidden states on disk: one safetensors file per shard, written as the batches arrive.

Layout of ``hidden_states/shard-K.safetensors`` (the contract in docs/design.md):
- ``offsets`` int64 [N+1]: sample k owns token rows ``offsets[k]:offsets[k+1]``, samples in the
  tokenized shard's row order;
- ``aux`` bf16 [T, 3H]: the three auxiliary layers side by side, in ``layer_ids`` order;
- ``last`` bf16 [T, H]: the last decoder layer's output, before the final norm.
The sample ids, layer ids and model sit in ``shard-K.index.json`` beside it.

Why a hand-written writer: a shard of an 8B target holds tens of GB of states, more than
memory. Every shape is known before the first forward (token counts come from the tokenized
shard), so the header is written first and each batch's rows go straight to their place with
``pwrite`` -- in any order, which lets extraction run in length-sorted batches. The file is a
hidden temp name until every sample is written, checked and fsynced, then renamed: a killed
run never leaves a complete-looking file with holes. Readers memory-map it (``safe_open``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from eagle3.durable import fsync_dir
from eagle3.extract.errors import StatesError

FORMAT = "eagle3-hidden-states/1"


def states_bytes(num_tokens: int, hidden: int) -> int:
    """Bytes of aux + last for ``num_tokens`` tokens: tokens x 4 x H x 2 (bf16)."""
    return num_tokens * 4 * hidden * 2


class StatesWriter:
    """Write one shard's states; ``write(k, aux, last)`` per sample, then ``commit()``."""

    def __init__(self, path: str | Path, lengths: list[int], hidden: int, metadata: dict[str, str] | None = None):
        self.path, self.hidden = Path(path), hidden
        self.offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.offsets[1:])
        total = int(self.offsets[-1])
        sizes = {"offsets": self.offsets.nbytes, "aux": total * 3 * hidden * 2, "last": total * hidden * 2}
        header, start = {}, 0
        for name, dtype, shape in (
            ("offsets", "I64", [len(lengths) + 1]),
            ("aux", "BF16", [total, 3 * hidden]),
            ("last", "BF16", [total, hidden]),
        ):
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + sizes[name]]}
            start += sizes[name]
        header["__metadata__"] = {"format": FORMAT, **(metadata or {})}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._base = 8 + len(raw)
        self._starts = {name: self._base + header[name]["data_offsets"][0] for name in ("aux", "last")}
        self._written = np.zeros(len(lengths), dtype=bool)
        self.tmp = self.path.with_name(f".{self.path.name}.partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.is_symlink():  # a link planted at the temporary name is removed, never written through
            self.tmp.unlink()
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
            os.pwrite(self._fd, self.offsets.tobytes(), self._base)
            os.ftruncate(self._fd, self._base + start)
        except OSError:
            self.abort()
            raise

    def write(self, k: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        n = int(self.offsets[k + 1] - self.offsets[k])
        if tuple(aux.shape) != (n, 3 * self.hidden) or tuple(last.shape) != (n, self.hidden):
            raise StatesError(
                f"{self.path.name}: sample {k} expects aux [{n}, {3 * self.hidden}] and last [{n}, {self.hidden}], "
                f"got {list(aux.shape)} and {list(last.shape)}"
            )
        aux, last = aux.to(torch.bfloat16).contiguous().cpu(), last.to(torch.bfloat16).contiguous().cpu()
        if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
            raise StatesError(
                f"{self.path.name}: sample {k} has non-finite hidden states (inf or nan) -- the target "
                "overflowed in this dtype"
            )
        row = int(self.offsets[k])
        os.pwrite(self._fd, aux.view(torch.int16).numpy().tobytes(), self._starts["aux"] + row * 3 * self.hidden * 2)
        os.pwrite(self._fd, last.view(torch.int16).numpy().tobytes(), self._starts["last"] + row * self.hidden * 2)
        self._written[k] = True

    def commit(self) -> None:
        """Every sample written: fsync and rename into place."""
        missing = np.flatnonzero(~self._written)
        if len(missing):
            self.abort()
            raise StatesError(
                f"{self.path.name}: {len(missing)} samples were never written (first: {missing[:5].tolist()})"
            )
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()


class ShardStates:
    """Read a stored shard: ``len()``, ``sample(k) -> (aux, last)`` as bf16 tensors (memory-mapped)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._file = safe_open(str(self.path), framework="pt")
        except Exception as exc:  # truncated or not safetensors at all
            raise StatesError(f"{self.path}: not a readable safetensors file ({exc})") from None
        meta = self._file.metadata() or {}
        if meta.get("format") != FORMAT:
            raise StatesError(f"{self.path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        self.metadata = meta
        self.offsets = self._file.get_tensor("offsets").numpy()
        self._aux, self._last = self._file.get_slice("aux"), self._file.get_slice("last")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        return self._aux[a:b], self._last[a:b]
