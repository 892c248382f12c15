"""Shared by the prepare-source tests (test_presets.py, test_mix.py): the preset fixtures, a config for
small runs, readers of the stage's output, and a stand-in for the hub loader."""

import json
from pathlib import Path

import pyarrow.parquet as pq

from eagle3.config import DEMO_RECIPE, load_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "presets"


def config(run_dir, *sets):
    return load_config(
        DEMO_RECIPE, [f'run_dir="{run_dir}"', "data.num_shards=2", "data.max_rejected_fraction=1.0", *sets]
    )


def kept(run_dir) -> dict:
    """{source_index: messages as (role, content) pairs} over every shard."""
    out = {}
    for path in sorted((Path(run_dir) / "prompts").glob("shard-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            out[row["source_index"]] = [(m["role"], m["content"]) for m in row["messages"]]
    return out


def rejected(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "prompts" / "rejected.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class FakeHub:
    """Stands in for datasets.load_dataset: records each call, serves ``rows`` (as a stream when asked)."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def __call__(self, path, **kwargs):
        import datasets

        self.calls.append((path, kwargs))
        ds = datasets.Dataset.from_list(self.rows)
        return ds.to_iterable_dataset() if kwargs.get("streaming") else ds
