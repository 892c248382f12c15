"""Tokenize stage benchmark.

    .venv/bin/python benchmarks/bench_tokenize.py [--n 4000] [--repeats 3]

- Two sample sizes: short (~300 tokens: chat-style answers) and long (~3,500 tokens: the
  reasoning traces this pipeline exists for). Rendering costs per message and encoding per
  token, so the ratio depends on length; both are reported.
- Template path (records without server ids): the whole stage on one shard (read JSONL, render
  with the chat template, batched encode, masks from the template's generation spans, length
  policy, Parquet + counts written) against raw batch encoding of the *same rendered texts* with
  the fast tokenizer (``tokenizer(texts)``; rendering not timed in the baseline). Target: stage
  >= 0.9 x baseline. Measured twice: as the stage runs for the tiny target (its template has a
  plain-Python renderer, eagle3/tokenize/renderers.py) and with every row rendered through jinja
  (what a template without such a renderer pays: ``stage_jinja_*``).
- Server-ids path (records with token ids): rows/s of the whole stage, with the template check on
  its sample of rows.
The runs alternate (stage, baseline, stage with jinja, stage again) --repeats times in one process,
so drift in a shared machine's speed hits all alike; times are medians, ``ratio`` is the median of
the per-round ratios, and ``*_cpu_s`` (process CPU seconds, all threads) shows the work apart from
the wall clock. The second stage run of each round is the A/A pair: ``summary.stage_aa_<size>`` is
the median per-round ratio of the two identical stage runs, the noise ``stage_vs_raw_<size>`` must
clear. Results: benchmarks/results/tokenize.json (through benchmarks/results_file.py) and a table
on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import results_file  # noqa: E402
from eagle3.config import DEMO_RECIPE, load_config  # noqa: E402
from eagle3.prepare.stage import run_prepare  # noqa: E402
from eagle3.records import JsonlAppender  # noqa: E402
from eagle3.run_facts import RunFacts  # noqa: E402
from eagle3.tokenize import build  # noqa: E402
from eagle3.tokenize.build import conversation, render_ids  # noqa: E402
from eagle3.tokenize.stage import tokenize_shard  # noqa: E402
from eagle3.tokenizer import load_tokenizer, tokenizer_path  # noqa: E402

WORDS = (
    "the model answers with a short proof that each step follows from the last one and then checks "
    "the result against a second method before writing it down in plain words for the reader"
).split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


SIZES = {"short": ((40, 300), (20, 120)), "long": ((1500, 3500), (200, 600))}


def make_run(work: Path, n: int, with_ids: bool, size: str = "short"):
    (r_lo, r_hi), (c_lo, c_hi) = SIZES[size]
    rng = random.Random(0)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "p.jsonl"
    src.write_text(
        "".join(
            json.dumps({"conversations": [{"from": "human", "value": f"{i}: {_text(rng, 10, 60)}"}]}) + "\n"
            for i in range(n)
        )
    )
    config = load_config(
        DEMO_RECIPE,
        [f'run_dir="{work / "run"}"', f'data.source="{src}"', "data.num_shards=1", "tokenize.max_seq_len=8192"],
    )
    run_prepare(config)
    import pyarrow.parquet as pq

    rows = pq.read_table(work / "run" / "prompts" / "shard-00000.parquet").to_pylist()
    tok = load_tokenizer(tokenizer_path(config))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = work / "run" / "generations"
    gen.mkdir(parents=True)
    with JsonlAppender(gen / "shard-00000.jsonl", fsync_every=10_000) as out:
        for row in rows:
            rec = {
                "id": row["id"],
                "reasoning": _text(rng, r_lo, r_hi),
                "content": _text(rng, c_lo, c_hi),
                "finish_reason": "stop",
            }
            if with_ids:
                rec["prompt_token_ids"] = render_ids(tok, row["messages"], add_generation_prompt=True)
                rec["completion_token_ids"] = tok.encode(
                    f"{rec['reasoning']}\n</think>\n\n{rec['content']}", add_special_tokens=False
                ) + [end]
            out.append(rec)
    (gen / "shard-00000.done.json").write_text("{}")
    return config, tok, rows


def time_stage_once(config, tok) -> tuple[object, float]:
    shutil.rmtree(Path(config.run_dir) / "tokenized", ignore_errors=True)
    facts = RunFacts.resolve(config)  # resolved where a run starts, not part of the stage's time
    started = time.perf_counter()
    result = tokenize_shard(facts, "shard-00000.parquet", tok)
    return result, time.perf_counter() - started


def time_stage(config, tok, repeats: int):
    runs = [time_stage_once(config, tok) for _ in range(repeats)]
    return runs[0][0], statistics.median(t for _, t in runs)


def timed(fn):
    """(result, wall seconds, process CPU seconds)."""
    cpu = time.process_time()
    result, wall = fn()
    return result, wall, time.process_time() - cpu


def time_raw_encode_once(tok, texts: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    enc = tok(texts, add_special_tokens=False)
    return time.perf_counter() - started, sum(len(x) for x in enc["input_ids"])


def measure(work: Path, n: int, size: str, repeats: int) -> dict:
    config, tok, rows = make_run(work / "template", n, with_ids=False, size=size)
    records = [
        json.loads(x) for x in (Path(config.run_dir) / "generations" / "shard-00000.jsonl").read_text().splitlines()
    ]
    by_id = {r["id"]: r for r in rows}
    texts = tok.apply_chat_template([conversation(by_id[r["id"]]["messages"], r) for r in records], tokenize=False)
    # Alternate so that drift in this shared machine's speed hits all alike; medians of each.
    runs: dict[str, list] = {"stage": [], "raw": [], "jinja": [], "stage_again": []}
    try:
        for _ in range(repeats):
            runs["stage"].append(timed(lambda: time_stage_once(config, tok)))
            runs["raw"].append(timed(lambda: time_raw_encode_once(tok, texts)[::-1]))
            build.FAST_RENDER = False
            runs["jinja"].append(timed(lambda: time_stage_once(config, tok)))
            build.FAST_RENDER = True
            runs["stage_again"].append(timed(lambda: time_stage_once(config, tok)))
    finally:
        build.FAST_RENDER = True
    result, raw_tokens = runs["stage"][0][0], runs["raw"][0][0]
    assert raw_tokens == result.tokens == runs["jinja"][0][0].tokens, (raw_tokens, result.tokens)
    med = {k: statistics.median(w for _, w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, _, c in v) for k, v in runs.items()}
    stage_s, raw_s, jinja_s = med["stage"], med["raw"], med["jinja"]
    template = {
        "samples": result.ok,
        "tokens": result.tokens,
        "stage_s": stage_s,
        "raw_encode_s": raw_s,
        "stage_samples_per_s": result.ok / stage_s,
        "stage_tokens_per_s": result.tokens / stage_s,
        "raw_samples_per_s": len(texts) / raw_s,
        "raw_tokens_per_s": raw_tokens / raw_s,
        "ratio": statistics.median(r[1] / s[1] for r, s in zip(runs["raw"], runs["stage"])),
        "stage_jinja_s": jinja_s,
        "stage_jinja_tokens_per_s": result.tokens / jinja_s,
        "ratio_jinja": statistics.median(r[1] / s[1] for r, s in zip(runs["raw"], runs["jinja"])),
        # A/A: the same stage run twice per round, as a throughput ratio (second / first)
        "stage_aa": statistics.median(a[1] / b[1] for a, b in zip(runs["stage"], runs["stage_again"])),
        "stage_cpu_s": cpu["stage"],
        "raw_cpu_s": cpu["raw"],
        "stage_jinja_cpu_s": cpu["jinja"],
        "rounds": {k: [round(w, 4) for _, w, _ in v] for k, v in runs.items()},
    }
    config, tok, _ = make_run(work / "ids", n, with_ids=True, size=size)
    result, ids_s = time_stage(config, tok, repeats)
    exact = {
        "rows": result.ok,
        "tokens": result.tokens,
        "stage_s": ids_s,
        "rows_per_s": result.ok / ids_s,
        "tokens_per_s": result.tokens / ids_s,
        "template_checked_rows": result.template_check["checked"],
    }
    return {"template_path": template, "server_ids_path": exact}


def summary_of(sizes: dict) -> dict:
    """Per size: the stage over raw encoding (target >= 0.9), the same with jinja rendering, the
    A/A noise of the stage, and the stage's tokens/s on both paths."""
    summary = {}
    for size, m in sizes.items():
        t, e = m["template_path"], m["server_ids_path"]
        summary[f"stage_vs_raw_{size}"] = round(t["ratio"], 4)
        summary[f"jinja_stage_vs_raw_{size}"] = round(t["ratio_jinja"], 4)
        summary[f"stage_aa_{size}"] = round(t["stage_aa"], 4)
        summary[f"stage_tokens_per_s_{size}"] = round(t["stage_tokens_per_s"])
        summary[f"server_ids_tokens_per_s_{size}"] = round(e["tokens_per_s"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tokenize.json"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-tok-"))

    out = {
        "n": args.n,
        "repeats": args.repeats,
        "loadavg_1min_before": os.getloadavg()[0],
        "sizes": {},
    }
    for size in SIZES:
        n = args.n if size == "short" else max(1, args.n // 8)
        out["sizes"][size] = measure(work / size, n, size, args.repeats)
    out["loadavg_1min_after"] = os.getloadavg()[0]
    results_file.write(args.out, "tokenize", summary_of(out["sizes"]), **out)
    print(
        "| samples | path | rows | mean tokens | stage samples/s | stage tokens/s | raw batch encode tokens/s | "
        "stage / raw | same, jinja render |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, m in out["sizes"].items():
        t, e = m["template_path"], m["server_ids_path"]
        print(
            f"| {size} | template | {t['samples']} | {t['tokens'] // t['samples']} | "
            f"{t['stage_samples_per_s']:.0f} | {t['stage_tokens_per_s']:.0f} | {t['raw_tokens_per_s']:.0f} | "
            f"{t['ratio']:.2f} | {t['ratio_jinja']:.2f} |"
        )
        print(
            f"| {size} | server ids | {e['rows']} | {e['tokens'] // e['rows']} | {e['rows_per_s']:.0f} | "
            f"{e['tokens_per_s']:.0f} | - | - | - |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
