"""Drafter training throughput.

    .venv/bin/python benchmarks/bench_train.py [--samples 96] [--steps-ttt 7] [--repeats 3]

- The stage's trainer (``eagle3.train.trainer.Trainer``: reads tokenized Parquet and memory-mapped
  bf16 states, computes the target distribution, TTT loss and metrics, logs a fsynced JSONL line
  per step; checkpoints off during the timed part) against a minimal hand-written loop of the same
  drafter on the same micro-batches, already collated in memory (forward, soft cross-entropy
  against the same target distribution, backward, clip, AdamW). Target: trainer >= 0.9 x loop.
- 2-process DDP on CPU (gloo) through torchrun at the same global batch, vs 1 process.
Both sides train on the tiny Qwen3 target's real extracted states. Results:
benchmarks/results/train.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eagle3.models import resolve_model  # noqa: E402


def make_run(work: Path, samples: int, ttt: int, epochs: int, *sets: str):
    from safetensors.numpy import save_file

    from eagle3.extract.stage import extract_shard, plan, record
    from extract_runs import make_run as tokenized_run

    rng = np.random.default_rng(0)
    lengths = tuple(int(x) for x in rng.integers(100, 400, samples))
    config, names = tokenized_run(
        work,
        (lengths[: samples // 2], lengths[samples // 2 :]),
        "train.batch_tokens=2048",
        f"train.ttt_steps={ttt}",
        "train.eval_fraction=0.05",
        f"train.epochs={epochs}",
        "train.save_every_steps=100000",
        "train.eval_every_steps=100000",
        *sets,
    )
    the_plan = plan(config, names)
    record(config, [extract_shard(config, s, the_plan) for s in names], the_plan)
    vocab = Path(config.run_dir) / "vocab"
    vocab.mkdir(exist_ok=True)
    save_file(
        {"d2t": np.zeros(4096, dtype=np.int64), "t2d": np.ones(4096, dtype=bool)},
        str(vocab / "draft_vocab.safetensors"),
    )
    return config, names


def time_trainer(config, names) -> tuple[float, int]:
    from eagle3.train.trainer import Dist, Trainer

    trainer = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
    trainer.save = lambda: None  # checkpoints are not part of the loop being compared
    trainer._evaluate = lambda epoch: None
    started = time.perf_counter()
    result = trainer.train()
    return time.perf_counter() - started, result["tokens"]


def time_minimal_loop(config, names) -> tuple[float, int]:
    """The same drafter, micro-batches and optimizer, with nothing but the math."""
    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.data import Dataset, collate, micro_batches
    from eagle3.train.target import load_target_head

    tc = config.train
    torch.manual_seed(tc.seed)
    head = load_target_head(resolve_model("tiny:qwen3"))
    model = Eagle3Drafter(DrafterConfig.from_target(head.config, 4096, [1, 2, 3]))
    model.init_from_target(
        head.embed, head.lm_head, torch.zeros(4096, dtype=torch.long), torch.ones(4096, dtype=torch.bool)
    )
    data = Dataset(config.run_dir, names, tc.eval_fraction, offline=True)
    batches = [collate([data.train[j] for j in b], data) for b in micro_batches(data.train, tc.batch_tokens)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.learning_rate, betas=(0.9, 0.95))
    tokens = 0
    started = time.perf_counter()
    for _ in range(tc.epochs):
        for ids, mask, valid, aux, last in batches:
            with torch.no_grad():
                target = torch.softmax(head.logits(last), -1)
            logits = model(ids, aux.float(), valid, tc.ttt_steps)
            loss = 0.0
            for k, q in enumerate(logits):
                p = torch.zeros_like(target)
                p[:, : target.shape[1] - 1 - k] = target[:, 1 + k :]
                m = torch.zeros_like(mask)
                m[:, : mask.shape[1] - 2 - k] = mask[:, 2 + k :]
                ce = -(p * torch.log_softmax(q, -1)).sum(-1)
                loss = loss + (0.8**k) * (ce * m).sum() / m.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            tokens += int(valid.sum())
    return time.perf_counter() - started, tokens


def time_torchrun(config, names, nproc: int, accum: int) -> tuple[float, int]:
    from eagle3.durable import atomic_write_json

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-train-"))
    config, names = make_run(work, args.samples, args.ttt, args.epochs)
    torch.set_num_threads(os.cpu_count() or 1)
    pairs = []
    for _ in range(args.repeats):  # alternate, best of each
        pairs.append((time_trainer(config, names), time_minimal_loop(config, names)))
    (stage_s, stage_tokens), (loop_s, loop_tokens) = min(p[0] for p in pairs), min(p[1] for p in pairs)
    assert stage_tokens == loop_tokens, (stage_tokens, loop_tokens)
    one = time_torchrun(config, names, 1, 2)
    two = time_torchrun(config, names, 2, 1)
    out = {
        "samples": args.samples,
        "ttt_steps": args.ttt,
        "epochs": args.epochs,
        "tokens": stage_tokens,
        "trainer_tokens_per_s": stage_tokens / stage_s,
        "minimal_loop_tokens_per_s": loop_tokens / loop_s,
        "ratio": loop_s / stage_s,
        "torchrun_1proc_accum2_tokens_per_s": one[1] / one[0],
        "torchrun_2proc_ddp_tokens_per_s": two[1] / two[0],
        "ddp_speedup": (two[1] / two[0]) / (one[1] / one[0]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print("| measurement | tokens/s | vs reference |")
    print("|---|---|---|")
    print(f"| minimal hand-written loop (reference) | {out['minimal_loop_tokens_per_s']:.0f} | 1 |")
    print(f"| stage trainer, 1 process | {out['trainer_tokens_per_s']:.0f} | {out['ratio']:.2f} |")
    print(f"| torchrun 1 process, grad_accum 2 | {out['torchrun_1proc_accum2_tokens_per_s']:.0f} | 1 |")
    print(
        f"| torchrun 2 processes DDP (gloo), same global batch | {out['torchrun_2proc_ddp_tokens_per_s']:.0f} | "
        f"{out['ddp_speedup']:.2f} |"
    )


if __name__ == "__main__":
    main()
