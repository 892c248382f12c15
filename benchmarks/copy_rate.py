"""How much of a data run's answers repeats its prompts: the share of completion tokens that end a 4-gram
occurring in the prompt (what n-gram lookup can draft), overall and per opening of the user turn
(``data.self_prompts.user_starts``), from ``generations/`` and ``prompts/``.

    .venv/bin/python benchmarks/copy_rate.py RUN_DIR [RUN_DIR ...] [--openings JSON_LIST]

``--openings``: the run's ``data.self_prompts.user_starts`` (a JSON list); without it every answer counts as
plain.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

N = 4


def opening_of(row: dict, openings: list[str]) -> str:
    user = next((m["content"] for m in reversed(row["messages"]) if m["role"] == "user"), "")
    return next((o.strip() for o in openings if o.strip() and user.startswith(o.strip())), "plain")


def copy_rate(run: Path, openings: list[str]) -> dict[str, dict]:
    kind = {}
    for shard in sorted((run / "prompts").glob("shard-*.parquet")):
        for row in pq.read_table(shard, columns=["id", "messages"]).to_pylist():
            kind[row["id"]] = opening_of(row, openings)
    counts: dict[str, list[int]] = {}
    for shard in sorted((run / "generations").glob("shard-?????.jsonl")):
        for line in shard.read_text().splitlines():
            record = json.loads(line)
            if "completion_token_ids" not in record:
                continue  # failed or filtered: no answer
            prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
            grams = {tuple(prompt[i : i + N]) for i in range(len(prompt) - N + 1)}
            text = prompt + completion
            hits = sum(tuple(text[j - N + 1 : j + 1]) in grams for j in range(len(prompt), len(text)))
            for key in ("all", kind.get(record["id"], "plain")):
                c = counts.setdefault(key, [0, 0, 0])
                c[0], c[1], c[2] = c[0] + hits, c[1] + len(completion), c[2] + 1
    return {k: {"rate": round(h / max(t, 1), 3), "answers": n, "tokens": t} for k, (h, t, n) in sorted(counts.items())}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--openings", type=json.loads, default=[])
    args = parser.parse_args()
    for run in args.runs:
        print(run, json.dumps(copy_rate(run, args.openings), indent=1))
