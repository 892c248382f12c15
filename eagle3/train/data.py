"""Training data: tokenized rows (+ stored states, offline) split, bucketed and ordered.

- Every tokenized row is a sample; the held-out split is chosen by a hash of its id
  (``split.is_heldout``), so it never changes with shard counts or reruns.
- Micro-batches: samples sorted by length and grouped up to ``batch_tokens`` padded tokens (the
  same bucketing as extraction). Each epoch shuffles the micro-batch order with a generator
  seeded by (seed, epoch), so the order is a pure function of the config: a resumed run skips to
  its step and sees exactly the batches an uninterrupted run would.
- An optimizer step takes ``processes x grad_accum`` consecutive micro-batches; process r gets
  slots ``r*grad_accum .. (r+1)*grad_accum-1``. The epoch's last step may be short; a process with
  fewer micro-batches than the fullest one makes up the count with zero-loss passes (each pass is a
  collective under FSDP), so no sample is dropped and no process waits on another.
- Offline: aux/last come from ``hidden_states/shard-K.safetensors`` (memory-mapped) after checking
  that its index lists the same ids in the same order as the tokenized shard.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from eagle3.extract.hf import length_batches
from eagle3.layout import RunLayout
from eagle3.run_facts import read_states_done, read_tokenized_done
from eagle3.schemas import TOKENIZED_IDS, TOKENIZED_INPUT_IDS, TOKENIZED_LOSS_MASK, check_schema
from eagle3.train.errors import TrainDataError
from eagle3.train.split import is_heldout


@dataclass
class Sample:
    id: str
    shard: int
    row: int
    input_ids: np.ndarray
    loss_mask: np.ndarray


class Dataset:
    def __init__(self, run_dir: str | Path, shards: list[str], eval_fraction: float, offline: bool):
        self.run = Path(run_dir)
        self.layout = RunLayout.of(run_dir)
        self.shards, self.offline = shards, offline
        self.train: list[Sample] = []
        self.heldout: list[Sample] = []
        self._states: dict[int, object] = {}
        for s, shard in enumerate(shards):
            files = self.layout.tokenized_files(shard)
            path = files["parquet"]
            if read_tokenized_done(files["done"]) is None:
                raise TrainDataError(f"{path}: not tokenized (no {files['done'].name}); run `eagle3 tokenize`")
            check_schema(path, (TOKENIZED_IDS, TOKENIZED_INPUT_IDS, TOKENIZED_LOSS_MASK), "tokenized shard")
            table = pq.read_table(path, columns=["id", "input_ids", "loss_mask"])
            ids = table.column("id").to_pylist()
            if offline:
                self._check_index(shard, ids)
            for row, (rid, seq, mask) in enumerate(
                zip(ids, table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())
            ):
                sample = Sample(rid, s, row, np.asarray(seq, dtype=np.int64), np.asarray(mask, dtype=np.uint8))
                (self.heldout if is_heldout(rid, eval_fraction) else self.train).append(sample)
        if not self.train:
            raise TrainDataError(
                f"{self.layout.tokenized}: no training samples (all {len(self.heldout)} rows fell in the "
                "held-out split)"
            )
        if not self.heldout:  # a tiny run: hold out one sample rather than evaluate on nothing
            self.heldout.append(self.train.pop())

    def _check_index(self, shard: str, ids: list[str]) -> None:
        files = self.layout.states_files(shard)
        index = files["index"]
        if read_states_done(files["done"]) is None:
            raise TrainDataError(f'{files["states"]}: no stored states (extract.mode="offline"); run `eagle3 extract`')
        listed = json.loads(index.read_text())["ids"]
        if listed != ids:
            raise TrainDataError(
                f"{index}: its ids differ from {self.layout.tokenized_files(shard)['parquet']} (extracted from an "
                "older tokenization?); run `eagle3 extract` again"
            )

    def states(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        from eagle3.extract.store import ShardStates

        if sample.shard not in self._states:
            self._states[sample.shard] = ShardStates(self.layout.states_files(self.shards[sample.shard])["states"])
        return self._states[sample.shard].sample(sample.row)


def micro_batches(samples: list[Sample], batch_tokens: int) -> list[list[int]]:
    batches = length_batches([len(s.input_ids) for s in samples], batch_tokens)
    return [sorted(b) for b in sorted(batches, key=lambda b: min(b))]  # canonical before the seeded shuffle


def epoch_steps(n_batches: int, seed: int, epoch: int, processes: int, accum: int) -> list[list[list[int]]]:
    """Micro-batch indices per optimizer step, per process: steps[i][rank] = [batch ids]."""
    order = list(range(n_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    per_step = processes * accum
    steps = []
    for start in range(0, n_batches, per_step):
        chunk = order[start : start + per_step]
        steps.append([chunk[r * accum : (r + 1) * accum] for r in range(processes)])
    return steps


def collate(samples: list[Sample], dataset: Dataset | None, pad_id: int = 0):
    """Right-padded tensors: input_ids, loss_mask, valid [B, T]; aux [B, T, 3H], last [B, T, H]
    when offline (else None)."""
    longest = max(len(s.input_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, longest), pad_id, dtype=torch.long)
    mask = torch.zeros((B, longest), dtype=torch.long)
    valid = torch.zeros((B, longest), dtype=torch.bool)
    aux = last = None
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.from_numpy(s.input_ids)
        mask[b, :n] = torch.from_numpy(s.loss_mask.astype(np.int64))
        valid[b, :n] = True
        if dataset is not None and dataset.offline:
            a, h = dataset.states(s)
            if aux is None:
                aux = torch.zeros((B, longest, a.shape[-1]), dtype=a.dtype)
                last = torch.zeros((B, longest, h.shape[-1]), dtype=h.dtype)
            aux[b, :n], last[b, :n] = a, h
    return ids, mask, valid, aux, last


def counted_positions(samples: list[Sample], steps: int) -> list[int]:
    """Per TTT step, the positions whose predicted token is supervised (the loss denominators)."""
    out = [0] * steps
    for s in samples:
        m = s.loss_mask
        for k in range(steps):
            out[k] += int(m[2 + k :].sum()) if len(m) > 2 + k else 0
    return out
