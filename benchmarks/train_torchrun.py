"""The trainer under torchrun (1 or 2 CPU processes, gloo), for bench_train's DDP comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_torchrun(config, names, nproc: int, accum: int) -> tuple[float, int]:
    """(seconds of the training loop, tokens) of one torchrun of the tiny target's run."""
    from eagle3.durable import atomic_write_json
    from eagle3.models import resolve_model

    run = Path(config.run_dir)
    for sub in ("checkpoints", "train"):
        subprocess.run(["rm", "-rf", str(run / sub)], check=True)
    request = run / "train" / "request.json"
    config = config.model_copy(update={"train": config.train.model_copy(update={"grad_accum": accum})})
    atomic_write_json(
        request,
        {
            "config": json.loads(config.model_dump_json()),
            "shards": names,
            "model_path": resolve_model("tiny:qwen3"),
            "layer_ids": [1, 2, 3],
            "result_path": str(run / "train" / "result.json"),
        },
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={29850 + nproc}",
        "-m",
        "eagle3.train.worker",
        str(request),
    ]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    result = json.loads((run / "train" / "result.json").read_text())
    return result["seconds"], result["tokens"]
