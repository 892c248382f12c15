"""Per-prompt counters at concurrency 1 and the acceptance tables built from them (matrix._visit, live)."""

from __future__ import annotations

import pytest

from eagle3.config import PipelineConfig
from eagle3.evaluate import live, matrix, measure


class _Server:
    """Stands in for a managed vLLM: each request adds its own drafts and accepted tokens to the counters."""

    base_url, root_url, api_key, served_model_name = "http://x/v1", "http://x", None, "m"

    def __init__(self, per_request: dict[str, tuple[int, int]]):
        self.per_request, self.drafts, self.accepted, self.requests = per_request, 0, 0, []

    def check(self):
        pass


def _patch(monkeypatch, server: _Server, found: bool = True):
    def fetch(_probe, _root, _key):
        return {
            "drafts": server.drafts,
            "draft_tokens": 3 * server.drafts,
            "accepted_tokens": server.accepted,
            "accepted_per_pos": [],
            "found": found,
        }

    def run_batch(_url, _key, _model, prompts, **kw):
        outcomes = []
        for p in prompts:
            server.requests.append((p["id"], kw["concurrency"]))
            drafts, accepted = server.per_request[p["id"]]
            server.drafts += drafts
            server.accepted += accepted
            outcomes.append(
                measure.Streamed(
                    token_ids=list(range(drafts + accepted + 1)),
                    first_chunk_tokens=1,
                    ttft_s=0.1,
                    decode_s=0.2,
                    chunks=2,
                )
            )
        return outcomes, 0.5

    monkeypatch.setattr(matrix.metrics, "fetch_metrics", fetch)
    monkeypatch.setattr(matrix.measure, "run_batch", run_batch)
    monkeypatch.setattr(matrix, "_cpu", lambda servers: None)


PROMPTS = [{"id": "a", "messages": []}, {"id": "b", "messages": []}, {"id": "c", "messages": []}]


def test_concurrency_one_reads_each_prompts_own_counters(monkeypatch):
    server = _Server({"a": (10, 5), "b": (20, 30), "c": (4, 0)})
    _patch(monkeypatch, server)
    record, ids = matrix._visit(server, [], PROMPTS, ("suite", 0.0, 1), PipelineConfig(), probe=None)
    rows = {r["id"]: r for r in record["per_prompt"]}
    assert [(r["drafts"], r["accepted_tokens"]) for r in rows.values()] == [(10, 5), (20, 30), (4, 0)]
    assert [rows[k]["completion_tokens"] for k in "abc"] == [16, 51, 5]
    assert record["counters"]["drafts"] == 34 and record["counters"]["accepted_tokens"] == 35
    assert server.requests == [("a", 1), ("b", 1), ("c", 1)] and len(ids) == 3


def test_higher_concurrency_keeps_one_batch_and_no_per_prompt_rows(monkeypatch):
    server = _Server({"a": (1, 1), "b": (1, 1), "c": (1, 1)})
    _patch(monkeypatch, server)
    record, _ = matrix._visit(server, [], PROMPTS, ("suite", 0.0, 4), PipelineConfig(), probe=None)
    assert record["per_prompt"] is None and {c for _, c in server.requests} == {4}


def test_no_speculation_rows_have_one_token_per_step(monkeypatch):
    server = _Server({"a": (0, 0), "b": (0, 0), "c": (0, 0)})
    _patch(monkeypatch, server, found=False)
    record, _ = matrix._visit(server, [], PROMPTS, ("suite", 0.0, 1), PipelineConfig(), probe=None)
    assert record["counters"] is None
    assert all(r["accepted_tokens"] == 0 and r["drafts"] == 0 for r in record["per_prompt"])


def test_acceptance_tables_use_round_zero_greedy_visits_and_the_suite_categories():
    def row(pid, n, a):
        return {"id": pid, "ok": True, "completion_tokens": n, "accepted_tokens": a, "drafts": n - a}

    sets = {
        "suite": {"prompts": [{"id": "code-001", "category": "code"}, {"id": "math-001", "category": "math"}]},
        "heldout": {"prompts": [{"id": "h1"}]},
    }
    visits = [
        {"prompt_set": "suite", "method": "trained", "round": 0, "temperature": 0.0,
         "per_prompt": [row("code-001", 30, 20), row("math-001", 20, 5)]},
        {"prompt_set": "suite", "method": "trained", "round": 1, "temperature": 0.0,
         "per_prompt": [row("code-001", 30, 0), row("math-001", 20, 0)]},
        {"prompt_set": "suite", "method": "trained", "round": 0, "temperature": 0.7,
         "per_prompt": [row("code-001", 30, 0), row("math-001", 20, 0)]},
        {"prompt_set": "heldout", "method": "trained", "round": 0, "temperature": 0.0,
         "per_prompt": [row("h1", 10, 5)]},
        {"prompt_set": "heldout", "method": "none", "round": 0, "temperature": 0.0, "per_prompt": None},
    ]  # fmt: skip
    tables = live.acceptance_tables(visits, sets)
    suite = tables["suite"]["trained"]
    assert suite["pooled"]["acceptance_length"] == pytest.approx(50 / 25)
    assert suite["categories"]["code"]["acceptance_length"] == pytest.approx(3.0)
    assert suite["categories"]["math"]["acceptance_length"] == pytest.approx(20 / 15)
    assert list(tables["heldout"]["trained"]["categories"]) == ["heldout"]
    assert "none" not in tables["heldout"]


def test_suite_prompt_set_config_knobs():
    cfg = PipelineConfig.model_validate({"evaluate": {"prompt_sets": ["suite"], "suite_per_category": 2}})
    assert cfg.evaluate.suite == "builtin:eval_suite" and cfg.evaluate.suite_per_category == 2
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"evaluate": {"suite_per_category": 0}})
