"""SIGKILL during tokenize, vocab and extract, at several points, then a rerun: the outputs are
byte-identical to an uninterrupted run's (prepare, generation and training have their own kill tests)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

STAGE = """
import sys
from eagle3.config import DEMO_RECIPE, load_config
from eagle3.tokenize.stage import tokenize_shard
from eagle3.tokenizer import load_tokenizer
from eagle3.vocab.stage import run_vocab
from eagle3.extract.stage import extract_shard, plan
from eagle3.run_facts import RunFacts
config = load_config(
    DEMO_RECIPE,
    [f'run_dir="{sys.argv[1]}"', 'data.num_shards=2', 'extract.dtype="float32"', 'vocab.draft_vocab_size=1000'],
)
names = ["shard-00000.parquet", "shard-00001.parquet"]
facts = RunFacts.resolve(config)
tok = load_tokenizer(facts.tokenizer()[0])
for s in names:
    tokenize_shard(facts, s, tok)
run_vocab(facts, names)
the_plan = plan(facts, names)
for s in names:
    extract_shard(config, s, the_plan)
print("done", flush=True)
"""


def make_inputs(run: Path, n: int = 400) -> None:
    """Prompt shards and finished generation shards with server ids, as the generate stage leaves them."""
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.prepare.stage import run_prepare
    from eagle3.records import JsonlAppender
    from eagle3.tokenize.build import render_ids
    from eagle3.tokenizer import load_tokenizer, tokenizer_path

    src = run.parent / f"{run.name}-prompts.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"question {i}: " + "word " * (i % 50)}]}) + "\n"
            for i in range(n)
        )
    )
    config = load_config(DEMO_RECIPE, [f'run_dir="{run}"', f'data.source="{src}"', "data.num_shards=2"])
    run_prepare(config)
    tok = load_tokenizer(tokenizer_path(config))
    import pyarrow.parquet as pq

    for s in range(2):
        rows = pq.read_table(run / "prompts" / f"shard-{s:05d}.parquet").to_pylist()
        gen = run / "generations"
        gen.mkdir(exist_ok=True)
        with JsonlAppender(gen / f"shard-{s:05d}.jsonl") as out:
            for k, row in enumerate(rows):
                answer = tok.encode(
                    f"thinking {k}\n</think>\n\nanswer " + "x " * (k % 40), add_special_tokens=False
                ) + [tok.convert_tokens_to_ids("<|im_end|>")]
                out.append(
                    {
                        "id": row["id"],
                        "prompt_token_ids": render_ids(tok, row["messages"], add_generation_prompt=True),
                        "completion_token_ids": answer,
                        "reasoning": f"thinking {k}",
                        "content": "answer",
                        "finish_reason": "stop",
                    }
                )
        (gen / f"shard-{s:05d}.done.json").write_text("{}")


def outputs(run: Path) -> dict[str, str]:
    """Hashes of every data file; the completion markers must exist (they hold paths and timings, so they differ)."""
    files = [
        *sorted((run / "tokenized").glob("shard-*")),
        run / "vocab" / "draft_vocab.safetensors",
        *sorted((run / "hidden_states").glob("shard-*")),
    ]
    assert len([f for f in files if f.name.endswith(".done.json")]) == 4
    return {
        str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in files
        if not f.name.endswith(".done.json")
    }


def stage(run: Path, background: bool = False):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if background:
        return subprocess.Popen(
            [sys.executable, "-c", STAGE, str(run)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    out = subprocess.run(
        [sys.executable, "-c", STAGE, str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-3000:]


@pytest.mark.timeout(900)
def test_sigkill_at_any_point_then_rerun_gives_the_clean_run_bytes(tmp_path):
    clean = tmp_path / "clean"
    make_inputs(clean)
    started = time.monotonic()
    stage(clean)
    took = time.monotonic() - started
    reference = outputs(clean)
    assert len(reference) == 2 * 3 + 1 + 2 * 2, sorted(reference)  # tokenized x3, vocab, states x2 per shard
    # Kill at three points of the work: tokenize under way, just after tokenize (vocab/extract next),
    # extraction of the second shard under way.
    points = ("tokenized", "tokenized/shard-00001.done.json", "hidden_states/shard-00000.done.json")
    for k, point in enumerate(points):
        run = tmp_path / f"killed-{k}"
        make_inputs(run)
        proc = stage(run, background=True)
        deadline = time.monotonic() + 10 * took + 60
        while not (run / point).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        markers = len(list(run.glob("tokenized/*.done.json"))) + len(list(run.glob("hidden_states/*.done.json")))
        assert markers < 4, f"killed at {point}: the kill came before the end"
        stage(run)
        assert outputs(run) == reference, f"killed when {point} appeared"
