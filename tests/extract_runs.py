"""Small run directories with tokenized shards, for the hidden-state tests."""

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3.config import DEMO_RECIPE, load_config

LENGTHS = (7, 40, 129, 3, 64)


def samples(lengths=LENGTHS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lengths]


def make_run(tmp_path: Path, shards=(LENGTHS, (12, 30)), *sets: str):
    run = tmp_path / "run"
    tok = run / "tokenized"
    tok.mkdir(parents=True)
    names = []
    for s, lengths in enumerate(shards):
        name = f"shard-{s:05d}.parquet"
        seqs = samples(lengths, seed=s)
        table = pa.table(
            {
                "id": [f"s{s}-{k}" for k in range(len(seqs))],
                "input_ids": pa.array(seqs, pa.list_(pa.int32())),
                "loss_mask": pa.array([[1] * len(x) for x in seqs], pa.list_(pa.uint8())),
                "num_tokens": pa.array([len(x) for x in seqs], pa.int32()),
            }
        )
        pq.write_table(table, tok / name)
        sha = hashlib.sha256((tok / name).read_bytes()).hexdigest()
        (tok / f"shard-{s:05d}.done.json").write_text(
            json.dumps({"parquet_sha256": sha, "result": {"tokens": sum(lengths), "ok": len(seqs)}})
        )
        names.append(name)
    config = load_config(
        DEMO_RECIPE, [f'run_dir="{run}"', 'extract.dtype="float32"', "extract.batch_tokens=256", *sets]
    )
    return config, names
