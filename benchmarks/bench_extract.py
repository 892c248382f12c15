"""Extract stage benchmark: the stage against a bare forward of the same model, and its bytes.

    .venv/bin/python benchmarks/bench_extract.py [--targets tiny,smollm2] [--rounds 3] [--vllm]

- Targets: the tiny Qwen3-style target the project builds offline (``tiny:qwen3``, the demo
  recipe's settings) and SmolLM2-135M (``models/smollm2-135m``, recipes/smollm2-135m-cpu.toml;
  skipped with a note when the folder is absent: ``make real-target`` builds it).
- Inputs: one tokenized shard per target, written as the tokenize stage writes it (Parquet with
  ``id``, ``input_ids``, ``loss_mask``, ``num_tokens`` and its ``done.json`` marker holding the
  Parquet's hash), holding synthetic token ids whose lengths follow the SmolLM2 run in
  benchmarks/results/real_target.json (1,000 samples, 270,702 tokens: a 30-120 token prompt and an
  answer capped at 256 tokens that ~45% of samples reach; mean ~270 tokens).
- ``stage``: ``extract_shard`` on that shard from nothing (its outputs removed first): read and
  check the Parquet, forward, store (bf16 safetensors, fsync, rename), index, marker. The target
  is loaded once before the rounds (both sides reuse it), so load time is in neither.
- ``bare``: the same extractor object (the same hooks on the same layers) run over the same
  length batches, whose padded id and mask tensors are built before the clock starts; the
  captured states are dropped. This is the floor: the decoder stack and nothing else.
- Rounds run bare, stage, bare again (the A/A pair), ``--rounds`` times in one process, so drift
  in a shared machine's speed hits both; ``stage_vs_bare`` is the median per-round ratio of
  tokens/s (target >= 0.85) and ``aa`` the median ratio of the two bare runs of a round. The same
  ratios of process CPU seconds (``*_cpu``) are steadier on a machine others load: they count the
  work, not the share of the cores the process got.
- Bytes: every file the stage writes for the shard (states, index, marker) against the minimum,
  the tensors alone: tokens x 4 x H x 2 in bf16 (``bytes_vs_min``, target <= 1.01).
- fp8: one extra stage run per round with ``extract.storage_dtype = "fp8_e4m3"``
  (``fp8_vs_bf16``: its tokens/s over the bf16 stage's; minimum tokens x (4 x H + 16)).
- Threads: the stage's own choice (``eagle3.extract.hf.cpu_threads``: one per usable core) unless
  ``--threads``; on a 2-core machine that others load, two threads that wait on each other made the
  same forward 3-10x slower and the ratios noise, so measurements there use ``--threads 1``.
- ``--vllm``: the vLLM backend on the tiny target (each call starts a vLLM engine, ~3 s on CPU
  plus ~6 s of imports): the stage (its shard in ``extract.vllm_chunk_tokens`` chunks, 5 here,
  from one worker) against ``extract_with_vllm`` alone on the same samples (one chunk, nothing
  stored), ``--rounds`` x (bare, stage, bare) after a warm-up call; medians. The worker's own
  timing lines split each call: engine start, extraction phase (its chunks added up), and the time
  outside the worker (``*_own_s``: writing the request, reading the states back, and for the
  stage, storing them). ``stage_own_vs_extract_phase`` is the stage's extra time outside the
  worker over the extraction phase: what the stage adds to vLLM's forward, engine start aside.
Results: benchmarks/results/extract.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

import results_file  # noqa: E402
from eagle3.config import DEMO_RECIPE, load_config  # noqa: E402
from eagle3.extract.store import states_bytes  # noqa: E402

SMOLLM2 = ROOT / "models" / "smollm2-135m"
TARGETS = {
    "tiny": (DEMO_RECIPE, ['server.model="tiny:qwen3"']),
    "smollm2": (ROOT / "recipes" / "smollm2-135m-cpu.toml", [f'server.model="{SMOLLM2}"']),
}
SHARD = "shard-00000.parquet"


def lengths_like_smollm2_run(n: int, seed: int = 0) -> list[int]:
    """A 30-120 token prompt plus an answer of 20-256 tokens, 45% of answers at the 256 cap."""
    rng = random.Random(seed)
    return [rng.randint(30, 120) + (256 if rng.random() < 0.45 else rng.randint(20, 256)) for _ in range(n)]


def write_tokenized(run: Path, lengths: list[int], vocab: int, seed: int = 0) -> None:
    """One tokenized shard as the tokenize stage leaves it: Parquet, then its marker with the hash."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32).numpy() for n in lengths]
    out = run / "tokenized"
    out.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": [f"b-{k}" for k in range(len(seqs))],
            "input_ids": pa.array(seqs, pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * len(x) for x in seqs], pa.list_(pa.uint8())),
            "num_tokens": pa.array(lengths, pa.int32()),
        }
    )
    pq.write_table(table, out / SHARD)
    sha = hashlib.sha256((out / SHARD).read_bytes()).hexdigest()
    (out / SHARD.replace(".parquet", ".done.json")).write_text(
        json.dumps({"stage": "tokenize", "parquet_sha256": sha, "result": {"tokens": sum(lengths), "ok": len(seqs)}})
    )


def config_for(target: str, run: Path, extra: list[str] = ()):
    recipe, sets = TARGETS[target]
    return load_config(recipe, [f'run_dir="{run}"', *sets, *extra])


def stage_once(config) -> tuple[float, float, int]:
    """(wall s, process CPU s, bytes written) of one extraction from nothing."""
    from eagle3.extract.stage import extract_shard, plan
    from eagle3.run_facts import RunFacts

    shutil.rmtree(Path(config.run_dir) / "hidden_states", ignore_errors=True)
    the_plan = plan(RunFacts.resolve(config), [SHARD])
    cpu, started = time.process_time(), time.perf_counter()
    result = extract_shard(config, SHARD, the_plan)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert not result.skipped and result.ok == result.in_
    written = sum(f.stat().st_size for f in (Path(config.run_dir) / "hidden_states").iterdir() if f.is_file())
    return wall, cpu, written


def padded_batches(extractor, seqs: list[list[int]], batch_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from eagle3.extract.hf import length_batches

    out = []
    for batch in length_batches([len(s) for s in seqs], batch_tokens):
        longest = max(len(seqs[k]) for k in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for b, k in enumerate(batch):
            ids[b, : len(seqs[k])] = torch.as_tensor(seqs[k])
            mask[b, : len(seqs[k])] = 1
        out.append((ids.to(extractor.device), mask.to(extractor.device)))
    return out


@torch.no_grad()
def bare_once(extractor, batches) -> tuple[float, float]:
    """The decoder stack with the stage's hooks over prepared batches; the captured states dropped."""
    cpu, started = time.process_time(), time.perf_counter()
    for ids, mask in batches:
        extractor.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
        extractor._captured.clear()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu


def measure(target: str, work: Path, samples: int, rounds: int, fp8: bool, threads: int = 0) -> dict:
    from eagle3.extract.hf import cached_extractor
    from eagle3.extract.stage import plan
    from eagle3.run_facts import RunFacts

    run = work / target
    config = config_for(target, run)
    facts = RunFacts.resolve(config)
    path = facts.model_dir()
    layers, hidden = facts.target_shape()
    from transformers import AutoConfig

    lengths = lengths_like_smollm2_run(samples)
    write_tokenized(run, lengths, int(AutoConfig.from_pretrained(path).vocab_size))
    the_plan = plan(facts, [SHARD])
    hs = config.extract
    extractor = cached_extractor(path, the_plan.layer_ids, hs.dtype, 0, hs.replicas)
    if threads:  # after the extractor, which sets the stage's own choice
        torch.set_num_threads(threads)
    seqs = pq.read_table(run / "tokenized" / SHARD, columns=["input_ids"]).column("input_ids").to_pylist()
    batches = padded_batches(extractor, seqs, hs.batch_tokens)
    tokens = sum(lengths)
    fp8_config = config_for(target, run, ['extract.storage_dtype="fp8_e4m3"'])
    stage_once(config)  # warm-up: first-touch allocations, lazy imports
    bare_once(extractor, batches)
    runs: dict[str, list] = {"bare": [], "stage": [], "bare_again": [], "stage_fp8": []}
    written = {}
    for _ in range(rounds):
        runs["bare"].append(bare_once(extractor, batches))
        wall, cpu, written["bf16"] = stage_once(config)
        runs["stage"].append((wall, cpu))
        runs["bare_again"].append(bare_once(extractor, batches))
        if fp8:
            wall, cpu, written["fp8"] = stage_once(fp8_config)
            runs["stage_fp8"].append((wall, cpu))
    shutil.rmtree(run / "hidden_states", ignore_errors=True)
    per_round = list(zip(runs["bare"], runs["stage"], runs["bare_again"]))
    minimum = states_bytes(tokens, hidden)
    out = {
        "model": config.server.model,
        "layers": layers,
        "hidden_size": hidden,
        "stored_layers": the_plan.layer_ids + [layers],
        "dtype": hs.dtype,
        "batch_tokens": hs.batch_tokens,
        "batches": len(batches),
        "padded_tokens": sum(ids.numel() for ids, _ in batches),
        "samples": samples,
        "tokens": tokens,
        "torch_threads": torch.get_num_threads(),
        "rounds": {k: [round(w, 4) for w, _ in v] for k, v in runs.items() if v},
        "cpu_s": {k: round(statistics.median(c for _, c in v), 4) for k, v in runs.items() if v},
        "stage_tokens_per_s": tokens / statistics.median(w for w, _ in runs["stage"]),
        "bare_tokens_per_s": tokens / statistics.median(w for w, _ in runs["bare"]),
        "stage_vs_bare": statistics.median(b[0] / s[0] for b, s, _ in per_round),
        "aa": statistics.median(results_file.aa(b[0], a[0]) for b, _, a in per_round),
        "stage_vs_bare_cpu": statistics.median(b[1] / s[1] for b, s, _ in per_round),
        "aa_cpu": statistics.median(results_file.aa(b[1], a[1]) for b, _, a in per_round),
        "bytes_written": written["bf16"],
        "bytes_min": minimum,
        "bytes_vs_min": written["bf16"] / minimum,
    }
    if fp8:
        fp8_min = states_bytes(tokens, hidden, "fp8_e4m3")
        out |= {
            "fp8_tokens_per_s": tokens / statistics.median(w for w, _ in runs["stage_fp8"]),
            "fp8_vs_bf16": statistics.median(s[0] / f[0] for s, f in zip(runs["stage"], runs["stage_fp8"])),
            "fp8_bytes_written": written["fp8"],
            "fp8_bytes_vs_min": written["fp8"] / fp8_min,
        }
    return out


class _WorkerLines(logging.Handler):
    """The vLLM worker's timing lines as they are logged: engine start, extraction phase, whole run."""

    PATTERNS = {
        "engine_s": re.compile(r"engine ready in ([0-9.]+) s"),
        "extract_s": re.compile(r"extracted \d+ samples in ([0-9.]+) s"),
        "worker_s": re.compile(r"vLLM worker finished in ([0-9.]+) s"),
    }

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for name, pattern in self.PATTERNS.items():
            if m := pattern.search(record.getMessage()):  # a chunked run: its chunks' phases added up
                self.seen[name] = self.seen.get(name, 0.0) + float(m.group(1))


def measure_vllm(work: Path, samples: int, rounds: int) -> dict:
    """The vLLM backend on the tiny target: the stage against extract_with_vllm alone on the same
    samples (each call starts an engine), ``rounds`` x (bare, stage, bare) after a warm-up call."""
    from eagle3.extract.stage import plan
    from eagle3.extract.vllm_backend import extract_with_vllm
    from eagle3.run_facts import RunFacts

    run = work / "tiny-vllm"
    config = config_for("tiny", run, ['extract.backend="vllm"'])
    lengths = lengths_like_smollm2_run(samples, seed=1)
    write_tokenized(run, lengths, 4096)
    the_plan = plan(RunFacts.resolve(config), [SHARD])
    table = pq.read_table(run / "tokenized" / SHARD, columns=["id", "input_ids"])
    pairs = list(zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist()))
    layers = [*the_plan.layer_ids, the_plan.num_layers]
    lines = _WorkerLines()
    logging.getLogger("eagle3").addHandler(lines)
    logging.getLogger("eagle3").setLevel(logging.INFO)

    def timed(call) -> dict:
        lines.seen = {}
        started = time.perf_counter()
        call()
        return {"wall_s": round(time.perf_counter() - started, 2), **lines.seen}

    def bare() -> dict:
        return timed(
            lambda: extract_with_vllm(
                config.server.python, the_plan.model_path, layers, pairs, work / "vllm-bare",
                config.extract.timeout_s, env=dict(config.server.env), log=logging.getLogger("eagle3.bench"),
            )
        )  # fmt: skip

    bare()  # warm-up: the first engine start pays cold caches (measured 75 s against 30 s after)
    per_round = []
    for _ in range(rounds):
        per_round.append({"bare": bare(), "stage": timed(lambda: stage_once(config)), "bare_again": bare()})
    logging.getLogger("eagle3").removeHandler(lines)

    def median(f) -> float:
        return statistics.median(f(r) for r in per_round)

    def own(call: dict) -> float:  # the call's time outside its vLLM worker: request, read back, store
        return call["wall_s"] - call["worker_s"]

    return {
        "samples": samples,
        "tokens": sum(lengths),
        "rounds": per_round,
        "stage_vs_bare": median(lambda r: r["bare"]["wall_s"] / r["stage"]["wall_s"]),
        "aa": median(lambda r: results_file.aa(r["bare"]["wall_s"], r["bare_again"]["wall_s"])),
        "engine_s": median(lambda r: r["stage"]["engine_s"]),
        "extract_phase_s": median(lambda r: r["stage"]["extract_s"]),
        "stage_own_s": median(lambda r: own(r["stage"])),
        "bare_own_s": median(lambda r: own(r["bare"])),
        "stage_own_vs_extract_phase": median(lambda r: (own(r["stage"]) - own(r["bare"])) / r["stage"]["extract_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="tiny,smollm2")
    parser.add_argument("--samples", default="tiny=400,smollm2=80", help="samples per target's shard")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-fp8", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for both sides (default: the stage's own choice, one per usable core); 1 on a "
        "machine others load, where threads waiting on each other's cores dominate (measured 3-10x slower)",
    )
    parser.add_argument("--vllm", action="store_true", help="also the vLLM backend (tiny target, small size)")
    parser.add_argument("--vllm-samples", type=int, default=1000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "extract.json"))
    args = parser.parse_args()
    sizes = dict(kv.split("=") for kv in args.samples.split(","))
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-extract-"))
    targets, notes = {}, []
    try:
        for target in filter(None, args.targets.split(",")):
            if target == "smollm2" and not SMOLLM2.is_dir():
                notes.append(f"smollm2 skipped: {SMOLLM2} not found (make real-target builds it)")
                continue
            targets[target] = measure(target, work, int(sizes[target]), args.rounds, not args.no_fp8, args.threads)
        vllm = measure_vllm(work, args.vllm_samples, args.rounds) if args.vllm else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    headline = targets.get("smollm2") or targets.get("tiny")
    if headline:
        summary |= {k: round(headline[k], 4) for k in ("stage_vs_bare", "bytes_vs_min", "aa")}
    for name, m in targets.items():
        keys = (
            "stage_vs_bare",
            "bytes_vs_min",
            "aa",
            "stage_vs_bare_cpu",
            "aa_cpu",
            "stage_tokens_per_s",
            "bare_tokens_per_s",
            "fp8_vs_bf16",
        )
        summary |= {f"{name}_{k}": round(m[k], 4) for k in keys if k in m}
    if vllm:
        summary["vllm_tiny_stage_vs_bare"] = round(vllm["stage_vs_bare"], 4)
        summary["vllm_tiny_aa"] = vllm["aa"]
        summary["vllm_tiny_stage_own_vs_extract_phase"] = round(vllm["stage_own_vs_extract_phase"], 4)
    results_file.write(
        args.out,
        "extract",
        summary,
        headline=("smollm2" if "smollm2" in targets else "tiny") + " hf backend",
        rounds=args.rounds,
        loadavg_1min=os.getloadavg()[0],
        targets=targets,
        vllm=vllm,
        notes=notes,
    )
    print("| target | tokens | bare tokens/s | stage tokens/s | stage / bare | A/A | bytes / min | fp8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in targets.items():
        print(
            f"| {name} | {m['tokens']} | {m['bare_tokens_per_s']:.0f} | {m['stage_tokens_per_s']:.0f} | "
            f"{m['stage_vs_bare']:.3f} | {m['aa']:.3f} | {m['bytes_vs_min']:.4f} | {m.get('fp8_vs_bf16', 0):.3f} |"
        )
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
