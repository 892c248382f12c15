"""Drafter training throughput, on the tiny target and at SmolLM2-135M's shapes.

    .venv/bin/python benchmarks/bench_train.py [--configs tiny,smollm2_8k,smollm2_32k] [--steps 2]
        [--rounds 3] [--samples 32] [--profile] [--compile] [--ddp]

- Per configuration (``train_shapes.CONFIGS``: tiny H 128 / vocab 4k / draft 4k; SmolLM2's H 576 /
  vocab 49,152 with a draft vocabulary of 8k or 32k; K = 7, random weights at SmolLM2's shapes), in
  a process of its own so that its peak memory is its own: the stage's trainer
  (``eagle3.train.trainer.Trainer``: reads tokenized Parquet and memory-mapped bf16 states, the target
  distribution, TTT loss and metrics, a fsynced JSONL line per step; checkpoints and evaluation off)
  against a minimal hand-written loop of the same drafter on the same micro-batches, already collated
  in memory (target logits at the draft ids, softmax, the drafter, soft cross-entropy, backward, clip,
  AdamW). Rounds alternate loop, trainer, loop again (the A/A pair: the noise a ratio must clear),
  the trainer with the chunked loss (``train.loss_chunk_tokens``), the trainer compiled
  (``--compile``); the best of each side is kept. Peak RSS per side is sampled every 5 ms.
- ``--profile``: torch.profiler over the trainer's steps at SmolLM2's shapes, its CPU time split by
  what each op works on (the target head over 49k ids, the draft lm_head, the loss over the draft
  vocab, attention, the rest of the drafter layer, the optimizer).
- ``--ddp``: 2-process DDP on CPU (gloo) through torchrun at the same global batch vs 1 process,
  on the tiny target (slow: two torchrun starts and two passes over the data each).
Results: benchmarks/results/train.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import train_shapes  # noqa: E402
from train_torchrun import time_torchrun  # noqa: E402

from results_file import aa, write  # noqa: E402


def make_run(work: Path, samples: int, ttt: int, epochs: int, *sets: str):
    """The tiny target's run (config, shard names): what bench_cluster_train trains."""
    config, names, _, _ = train_shapes.make_run(work, "tiny", samples, ttt, f"train.epochs={epochs}", *sets)
    return config, names


class PeakRSS:
    """The largest resident set size seen while the block runs (sampled every 5 ms), in bytes."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def _watch(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def trainer(config, names, folder, layers, **train):
    from eagle3.train.trainer import Dist, Trainer

    config = config.model_copy(update={"train": config.train.model_copy(update=train)})
    t = Trainer(config, names, folder, layers, Dist(), log=lambda m: None)
    t.save = lambda: None  # checkpoints are not part of the loop being compared
    t._evaluate = lambda epoch: None
    return t


def time_trainer(config, names, folder, layers, **train) -> dict:
    t = trainer(config, names, folder, layers, **train)
    with PeakRSS() as mem:
        started = time.perf_counter()
        result = t.train()
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": result["tokens"], "peak_rss": mem.peak, "cuda_peak": mem.cuda_peak}


def minimal_loop(config, names, folder, layers, steps: int):
    """The same drafter, micro-batches (in the trainer's order) and optimizer, with nothing but the math."""
    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.train.data import Dataset, collate, epoch_steps, micro_batches
    from eagle3.train.target import load_target_head
    from eagle3.vocab.mapping import load as load_vocab

    tc = config.train
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(tc.seed)
    head = load_target_head(folder)
    d2t, t2d = (torch.from_numpy(x) for x in load_vocab(Path(config.run_dir) / "vocab" / "draft_vocab.safetensors"))
    model = Eagle3Drafter(DrafterConfig.from_target(head.config, len(d2t), layers))
    model.init_from_target(head.embed, head.lm_head, d2t, t2d)
    model, head = model.to(dev), head.to(dev)
    draft_ids = (torch.arange(len(d2t)) + d2t).to(dev)
    data = Dataset(config.run_dir, names, tc.eval_fraction, offline=True)
    batches = micro_batches(data.train, tc.batch_tokens)
    order = [b for step in epoch_steps(len(batches), tc.seed, 0, 1, 1) for b in step[0]][:steps]
    batches = [[t.to(dev) for t in collate([data.train[j] for j in batches[b]], data)] for b in order]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.learning_rate, betas=(0.9, 0.95))
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)

    def run() -> int:
        tokens = 0
        for ids, mask, valid, aux, last in batches:
            with torch.no_grad():
                target = torch.softmax(head.logits(last)[..., draft_ids], -1)
            with amp:
                logits = model(ids, aux.float(), valid, tc.ttt_steps)
            loss = 0.0
            for k, q in enumerate(logits):
                p = torch.zeros_like(target)
                p[:, : target.shape[1] - 1 - k] = target[:, 1 + k :]
                m = torch.zeros_like(mask)
                m[:, : mask.shape[1] - 2 - k] = mask[:, 2 + k :]
                ce = -(p * torch.log_softmax(q.float(), -1)).sum(-1)
                loss = loss + (0.8**k) * (ce * m).sum() / m.sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            tokens += int(valid.sum())
        return tokens

    return run


def time_minimal_loop(config, names, folder, layers, steps: int) -> dict:
    run = minimal_loop(config, names, folder, layers, steps)
    with PeakRSS() as mem:
        started = time.perf_counter()
        tokens = run()
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": tokens, "peak_rss": mem.peak, "cuda_peak": mem.cuda_peak}


def one_config(name: str, args) -> dict:
    """Every side of one configuration, alternated over rounds; the best time of each side."""
    work = Path(tempfile.mkdtemp(prefix=f"eagle3-bench-train-{name}-"))
    config, names, folder, layers = train_shapes.make_run(
        work, name, args.samples, args.ttt, "train.epochs=1", f"train.max_steps={args.steps}"
    )
    plain = {"loss_chunk_tokens": 0}
    sides = {
        "loop": lambda: time_minimal_loop(config, names, folder, layers, args.steps),
        "stage": lambda: time_trainer(config, names, folder, layers, **plain),
        "loop_again": lambda: time_minimal_loop(config, names, folder, layers, args.steps),
        "stage_chunked": lambda: time_trainer(config, names, folder, layers, loss_chunk_tokens=args.chunk_tokens),
    }
    if args.compile:
        sides["stage_compiled"] = lambda: time_trainer(config, names, folder, layers, **plain, compile=True)
    time_minimal_loop(config, names, folder, layers, 1)  # warm the process (allocator, page cache)
    runs = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, fn in sides.items():
            runs[side].append(fn())
            print(f"  {name} {side}: {runs[side][-1]['seconds']:.2f} s", flush=True)
    best = {side: min(r, key=lambda x: x["seconds"]) for side, r in runs.items()}
    tokens = {side: b["tokens"] for side, b in best.items()}
    assert len(set(tokens.values())) == 1, tokens
    out = {
        "config": name,
        "target": train_shapes.CONFIGS[name][0],
        "draft_vocab": train_shapes.CONFIGS[name][1],
        "runs": runs,
        "best": best,
    }
    if args.profile and name != "tiny":
        out["profile"] = profile(config, names, folder, layers, name, args)
    return out


def profile(config, names, folder, layers, name, args) -> dict:
    """The trainer's CPU time (self time of every op) split by what the op works on, over one
    optimizer step of the plain loss and one of the chunked loss."""
    import torch.profiler as tp
    from train_profile import breakdown

    out = {}
    for path, chunk in (("plain", 0), ("chunked", args.chunk_tokens)):
        t = trainer(config, names, folder, layers, loss_chunk_tokens=chunk, max_steps=1)
        with tp.profile(activities=[tp.ProfilerActivity.CPU], record_shapes=True) as prof:
            t.train()
        out[path] = breakdown(prof, target_vocab=49152, draft_vocab=train_shapes.CONFIGS[name][1], heads=9, hidden=576)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(train_shapes.CONFIGS))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also time the trainer with train.compile=true")
    parser.add_argument("--ddp", action="store_true", help="also time 2-process DDP vs 1 process (slow)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train.json"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.one:
        Path(args.part).write_text(json.dumps(one_config(args.one, args)))
        return
    results = {}
    for name in args.configs.split(","):
        part = Path(tempfile.mkstemp(suffix=".json")[1])
        child = [a for a in sys.argv[1:]]
        subprocess.run([sys.executable, __file__, *child, "--one", name, "--part", str(part)], check=True)
        results[name] = json.loads(part.read_text())
    ddp = None
    if args.ddp:
        work = Path(tempfile.mkdtemp(prefix="eagle3-bench-train-ddp-"))
        config, names = make_run(work, 96, args.ttt, 2)
        one, two = time_torchrun(config, names, 1, 2), time_torchrun(config, names, 2, 1)
        ddp = {
            "torchrun_1proc_accum2_tokens_per_s": one[1] / one[0],
            "torchrun_2proc_ddp_tokens_per_s": two[1] / two[0],
            "ddp_speedup": (two[1] / two[0]) / (one[1] / one[0]),
        }
    report(results, ddp, args)


def report(results: dict, ddp: dict | None, args) -> None:
    summary, rows = {}, []
    for name, r in results.items():
        best = r["best"]
        tps = {side: b["tokens"] / b["seconds"] for side, b in best.items()}
        summary[f"stage_vs_loop_{name}"] = round(tps["stage"] / tps["loop"], 3)  # both with the plain loss
        # the stage as it ships (train.loss_chunk_tokens on by default) against the same minimal loop
        summary[f"default_stage_vs_loop_{name}"] = round(tps["stage_chunked"] / tps["loop"], 3)
        summary[f"chunked_vs_plain_{name}"] = round(tps["stage_chunked"] / tps["stage"], 3)
        summary[f"aa_{name}"] = aa(best["loop"]["seconds"], best["loop_again"]["seconds"])
        summary[f"peak_rss_gib_{name}"] = round(best["stage"]["peak_rss"] / 2**30, 2)
        summary[f"peak_rss_gib_chunked_{name}"] = round(best["stage_chunked"]["peak_rss"] / 2**30, 2)
        if "stage_compiled" in tps:
            summary[f"compiled_vs_plain_{name}"] = round(tps["stage_compiled"] / tps["stage"], 3)
        for side, value in tps.items():
            rows.append((name, side, value, value / tps["loop"], best[side]["peak_rss"] / 2**30))
    summary["aa"] = min((v for k, v in summary.items() if k.startswith("aa_")), key=lambda v: -abs(v - 1))
    if ddp:
        summary["ddp_speedup"] = round(ddp["ddp_speedup"], 3)
    write(
        args.out,
        "train",
        summary,
        ttt_steps=args.ttt,
        steps_per_run=args.steps,
        rounds=args.rounds,
        chunk_tokens=args.chunk_tokens,
        weights="random at SmolLM2-135M's shapes (speed only); the tiny target's real extracted states",
        configs=results,
        ddp=ddp,
    )
    print("| config | side | tokens/s | vs loop | peak RSS GiB |")
    print("|---|---|---|---|---|")
    for name, side, value, ratio, rss in rows:
        print(f"| {name} | {side} | {value:.0f} | {ratio:.2f} | {rss:.2f} |")
    for name, r in results.items():
        for path, prof in r.get("profile", {}).items():
            print(f"profile {name} {path}: " + ", ".join(f"{k} {v:.0%}" for k, v in prof["share"].items()))
    if ddp:
        print(f"DDP 2 processes vs 1 (tiny, same global batch): {ddp['ddp_speedup']:.2f}")


if __name__ == "__main__":
    main()
