"""What ``train.compile`` (torch.compile of the drafter's forward) gives: the compile's own time and
the steps after it, against the same trainer eager, per shape and loss.

    .venv/bin/python benchmarks/bench_train_compile.py [--cases tiny:plain,tiny:chunked,smollm2_8k:plain]
        [--steps 4]

- Shapes from ``train_shapes`` (tiny: H 128, vocab 4k; smollm2_8k: SmolLM2-135M's H 576 and vocab 49,152
  with an 8k draft vocabulary, random weights), K = 7, 32 samples; losses: ``plain``
  (``train.loss_chunk_tokens = 0``) and ``chunked`` (the default, 1,024 rows at a time).
- Compiles are cold: each case gets its own empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and a reset
  dynamo, as a first run pays (``--warm-cache`` keeps the machine's cache: a rerun of the same shapes).
- Per case, in one process, in this order: an eager warm-up step; ``--steps`` optimizer steps eager; one step
  compiled (``compile_s``: the compile, dominated by it); ``--steps`` steps compiled (dynamo's cache reused:
  the steady state); ``--steps`` steps eager again (the A/A pair). ``compiled_vs_eager_*`` is the mean of the
  two eager times over the compiled one (> 1: compiled is faster); ``break_even_steps_*`` is how many steps
  the compile takes to pay back at that rate (none when it never does).
Results: benchmarks/results/train_compile.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bench_train  # noqa: E402
import train_shapes  # noqa: E402

import results_file  # noqa: E402

CHUNK = {"plain": 0, "chunked": 1024}


def one_case(shape: str, loss: str, steps: int, warm_cache: bool = False) -> dict:
    import torch

    work = Path(tempfile.mkdtemp(prefix=f"eagle3-bench-compile-{shape}-"))
    if not warm_cache:  # a cold compile, as a first run pays: no kernels from an earlier case or run
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
    torch._dynamo.reset()
    config, names, folder, layers = train_shapes.make_run(
        work, shape, 32, 7, "train.epochs=1", f"train.max_steps={steps}"
    )

    def timed(**train) -> float:
        t = bench_train.trainer(config, names, folder, layers, loss_chunk_tokens=CHUNK[loss], **train)
        started = time.perf_counter()
        t.train()
        return time.perf_counter() - started

    timed(max_steps=1)  # warm the process
    eager = timed()
    compile_s = timed(compile=True, max_steps=1)
    compiled = timed(compile=True)
    eager_again = timed()
    per_step_gain = ((eager + eager_again) / 2 - compiled) / steps
    row = {
        "shape": shape,
        "loss": loss,
        "steps": steps,
        "eager_s": round(eager, 3),
        "compile_first_step_s": round(compile_s, 2),
        "compiled_s": round(compiled, 3),
        "eager_again_s": round(eager_again, 3),
        "compiled_vs_eager": round((eager + eager_again) / 2 / compiled, 4),
        "aa": results_file.aa(eager, eager_again),
        "break_even_steps": round(compile_s / per_step_gain) if per_step_gain > 0 else None,
    }
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="tiny:plain,tiny:chunked,smollm2_8k:plain")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="keep inductor's on-disk cache (a rerun of the same shapes compiles in ~30 s instead of 100-150 s)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_compile.json"))
    args = parser.parse_args()
    started = results_file.provenance()
    rows = [one_case(*case.split(":"), args.steps, args.warm_cache) for case in args.cases.split(",")]
    summary = {"warm_cache": int(args.warm_cache)}
    for r in rows:
        name = f"{r['shape']}_{r['loss']}"
        summary[f"compiled_vs_eager_{name}"] = r["compiled_vs_eager"]
        summary[f"compile_s_{name}"] = r["compile_first_step_s"]
        summary[f"aa_{name}"] = r["aa"]
    results_file.write(args.out, "train_compile", summary, started=started, loadavg_1min=os.getloadavg()[0], cases=rows)
    print("| shape | loss | compile (first step) s | eager s | compiled s | compiled vs eager | A/A | break-even |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['loss']} | {r['compile_first_step_s']} | {r['eager_s']} | {r['compiled_s']} | "
            f"{r['compiled_vs_eager']} | {r['aa']} | {r['break_even_steps'] or 'never'} |"
        )


if __name__ == "__main__":
    main()
