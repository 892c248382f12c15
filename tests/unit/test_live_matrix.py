"""Live evaluation arithmetic without a server: decode rate, alternation order, counter deltas
per cell, speed-ups, the greedy check, the table and the external prompt set."""

from __future__ import annotations

import json

import httpx
import pytest

from eagle3.evaluate import matrix, measure, metrics
from eagle3.evaluate.measure import Streamed
from eagle3.run_facts import RunFacts


def _ok(tokens: int, first: int, decode_s: float, ttft: float = 0.5) -> Streamed:
    return Streamed(token_ids=list(range(tokens)), first_chunk_tokens=first, ttft_s=ttft, decode_s=decode_s, chunks=2)


def test_decode_rate_is_tokens_after_the_first_chunk_over_first_to_last_chunk_time():
    outcomes = [
        _ok(11, 1, 2.0),
        _ok(21, 1, 2.0),
        Streamed(error="timeout"),
        Streamed(token_ids=[7], first_chunk_tokens=1, ttft_s=0.3, decode_s=0.0, chunks=1),
    ]  # one chunk: no decode time
    stats = measure.summarize(outcomes, wall_s=5.0)
    assert (stats["requests"], stats["requests_ok"], stats["requests_failed"], stats["errors"]) == (
        4,
        3,
        1,
        {"timeout": 1},
    )
    assert stats["completion_tokens"] == 33 and stats["decode_tokens"] == 30 and stats["decode_s"] == pytest.approx(4.0)
    r = measure.rates(stats)
    assert r["decode_tokens_per_s"] == pytest.approx(30 / 4.0)  # pooled, not the mean of per-request rates
    assert r["throughput_tokens_per_s"] == pytest.approx(33 / 5.0)
    assert r["mean_ttft_s"] == pytest.approx((0.5 + 0.5 + 0.3) / 3)
    both = measure.add_stats(stats, measure.summarize([_ok(5, 3, 1.0)], wall_s=1.0))
    assert measure.rates(both)["decode_tokens_per_s"] == pytest.approx(32 / 5.0)
    assert measure.rates(measure.summarize([Streamed(error="http_500")], 1.0))["decode_tokens_per_s"] is None


def _sse(events: list, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _post(content: bytes, status: int = 200) -> Streamed:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))
    with httpx.Client(transport=transport) as client:
        return measure.stream_request(client, "http://x/v1/chat/completions", {}, {"stream": True}, total_timeout_s=30)


def test_stream_reads_token_ids_per_chunk_and_the_usage():
    chunk = lambda ids: {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": ids}]}  # noqa: E731
    out = _post(
        _sse(
            [
                {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                chunk([5, 6]),
                chunk([7]),
                chunk([8, 9, 10]),
                {"choices": [], "usage": {"completion_tokens": 6}},
            ]
        )
    )
    assert out.error is None and out.token_ids == [5, 6, 7, 8, 9, 10] and out.first_chunk_tokens == 2
    assert (
        out.chunks == 3 and out.decode_tokens == 4 and out.usage_tokens == 6 and out.decode_s >= 0 and out.ttft_s >= 0
    )
    assert _post(b"", status=503).error == "http_503"
    assert _post(_sse([{"error": {"message": "boom"}}])).error == "stream_error"
    assert _post(_sse([{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}])).error == "no_tokens"
    assert _post(b"data: {not json\n\n").error == "bad_response"


def test_request_body_streams_token_ids_and_greedy_ignores_top_p():
    body = measure.request_body(
        "m", {"messages": [{"role": "user", "content": "hi"}]}, temperature=0.0, top_p=0.9, max_tokens=7
    )
    assert body["stream"] and body["return_token_ids"] and body["stream_options"] == {"include_usage": True}
    assert body["top_p"] == 1.0 and body["max_tokens"] == 7
    assert measure.request_body("m", {"messages": []}, temperature=0.6, top_p=0.9, max_tokens=7)["top_p"] == 0.9


@pytest.mark.parametrize("strategy", ["side_by_side", "restart"])
def test_every_round_visits_every_method_for_every_cell_in_rotated_order(strategy):
    methods, cells = (
        ["none", "ngram", "untrained", "trained"],
        [("heldout", 0.0, 1), ("heldout", 0.0, 8), ("external", 0.6, 1)],
    )
    order = matrix.visit_order(methods, cells, rounds=4, strategy=strategy)
    assert len(order) == 4 * len(methods) * len(cells) == len(set(order))
    for r in range(4):
        visits = [(m, c) for rr, m, c in order if rr == r]
        assert {(m, c) for m, c in visits} == {(m, c) for m in methods for c in cells}
        for cell in cells:  # the methods' order in this round is the list rotated by r
            assert [m for m, c in visits if c == cell] == methods[r:] + methods[:r]
    # over rounds every method takes every position once: linear drift falls on all alike
    first = [next(m for rr, m, c in order if rr == r and c == cells[0]) for r in range(4)]
    assert sorted(first) == sorted(methods)
    if strategy == "restart":  # one server per (round, method) block: methods x rounds starts
        blocks = [(r, m) for r, m, _ in order]
        assert len([b for k, b in enumerate(blocks) if k == 0 or blocks[k - 1] != b]) == 4 * len(methods)
    else:  # side by side: methods interleave within each cell
        assert [m for _, m, _ in order[:4]] == methods


def _raw(drafts, accepted, per, k=3):
    return {"drafts": drafts, "draft_tokens": k * drafts, "accepted_tokens": accepted, "accepted_per_position": per}


def _visit(method, rnd, counters, tokens, decode_s, ids, temperature=0.0, concurrency=1):
    stats = measure.summarize([_ok(tokens, 1, decode_s)], wall_s=decode_s + 1)
    return {
        "round": rnd,
        "method": method,
        "prompt_set": "heldout",
        "temperature": temperature,
        "concurrency": concurrency,
        "stats": stats,
        "counters": counters,
        "server_cpu_s": 1.0,
        "idle_servers_cpu_s": None,
        "token_ids": [ids],
    }  # one prompt


def test_counter_deltas_add_up_per_cell_and_rates_come_from_the_sums():
    before = metrics.parse_spec_metrics("")
    after = {
        "drafts": 10.0,
        "draft_tokens": 30.0,
        "accepted_tokens": 12.0,
        "accepted_per_pos": [7.0, 4.0, 1.0],
        "found": True,
    }
    one = metrics.raw_delta(before, after)
    assert one == _raw(10, 12, [7, 4, 1])
    two = metrics.add_raw(one, _raw(30, 6, [6]))
    assert two == _raw(40, 18, [13, 4, 1])
    cell = matrix.pool_cell(
        "trained", [_visit("trained", 0, one, 11, 1.0, [1]), _visit("trained", 1, _raw(30, 6, [6]), 21, 4.0, [1])]
    )
    assert cell["mean_acceptance_length"] == pytest.approx(1 + 18 / 40)  # summed counters, not the mean of 2.2 and 1.2
    assert cell["acceptance_rate"] == pytest.approx(18 / 120)
    assert cell["per_position_acceptance"] == pytest.approx([13 / 40, 4 / 40, 1 / 40])
    assert [r["mean_acceptance_length"] for r in cell["rounds"]] == pytest.approx([2.2, 1.2])
    assert cell["decode_tokens_per_s"] == pytest.approx(30 / 5.0)
    assert cell["decode_tokens_per_s_spread"]["min"] == pytest.approx(5.0) and cell["decode_tokens_per_s_spread"][
        "max"
    ] == pytest.approx(10.0)


def test_no_speculation_has_acceptance_one_by_definition_and_speedups_divide_decode_rates():
    visits = [
        _visit("none", 0, None, 21, 4.0, [1, 2, 3]),
        _visit("ngram", 0, _raw(2, 4, [2, 1, 1]), 21, 2.0, [1, 2, 3]),
        _visit("trained", 0, _raw(8, 8, [5, 2, 1]), 21, 1.0, [1, 2, 9]),
    ]
    cells = {c["method"]: c for c in matrix.pool_cells(visits, ["none", "ngram", "trained"])}
    assert cells["none"]["mean_acceptance_length"] == 1.0 and cells["none"]["counters"] is None
    assert "definition" in cells["none"]["acceptance_source"] and "proposed" in cells["ngram"]["acceptance_source"]
    assert cells["ngram"]["counters"] == _raw(2, 4, [2, 1, 1]) and cells["ngram"]["mean_acceptance_length"] == 3.0
    assert cells["trained"]["speedup_vs_none"] == pytest.approx(4.0) and cells["trained"][
        "speedup_vs_ngram"
    ] == pytest.approx(2.0)
    assert cells["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert (
        cells["ngram"]["greedy_identical"],
        cells["trained"]["greedy_identical"],
        cells["trained"]["greedy_compared"],
    ) == (1, 0, 1)


def test_sampled_cells_skip_the_greedy_check_and_a_missing_counter_page_is_no_acceptance():
    visits = [
        _visit("none", 0, None, 5, 1.0, [1], temperature=0.6),
        _visit("trained", 0, None, 5, 1.0, [2], temperature=0.6),
    ]
    cells = {c["method"]: c for c in matrix.pool_cells(visits, ["none", "trained"])}
    assert "greedy_compared" not in cells["trained"]
    assert cells["trained"]["mean_acceptance_length"] is None
    from eagle3.evaluate.live import problems

    assert problems(list(cells.values())) == [
        "trained heldout T=0.6 c=1: vLLM made no drafts (speculative decoding not engaged)"
    ]


def _doc():
    from eagle3.evaluate.live import DECODE_RATE_DEFINITION, headline

    visits = [
        _visit("none", 0, None, 21, 4.0, [1]),
        _visit("ngram", 0, _raw(2, 4, [2, 1, 1]), 21, 2.0, [1]),
        _visit("trained", 0, _raw(8, 8, [5, 2, 1]), 21, 1.0, [1]),
    ]
    doc = {
        "cells": matrix.pool_cells(visits, ["none", "ngram", "trained"]),
        "num_speculative_tokens": 3,
        "max_tokens": 32,
        "rounds": 1,
        "servers": "restart",
        "decode_rate_definition": DECODE_RATE_DEFINITION,
        "prompt_sets": {
            "heldout": {"label": "held-out split", "selection": {"note": "topped up"}, "prompt_ids": ["a"]}
        },
    }
    doc["headline"] = headline(doc)
    return doc


def test_table_renders_every_cell_with_speedups_and_labels():
    from eagle3.evaluate.table import markdown_table, summary_line

    text = markdown_table(_doc())
    rows = [line for line in text.splitlines() if line.startswith("| heldout")]
    assert len(rows) == 3
    assert rows[0].startswith("| heldout | 0 | 1 | none | 5.0 | 1.00x | 0.50x | 1 (by definition) |")
    assert "| trained | 20.0 | 4.00x | 2.00x | 2.00 | 0.62, 0.25, 0.12 |" in rows[2] and rows[2].endswith(
        "| 1/1 | 1/1 |"
    )
    assert "3.00 (steps with a proposal only)" in rows[1]
    assert "**heldout** (1 prompts): held-out split. Note: topped up" in text and "sum_i (n_i - f_i)" in text
    line = summary_line(_doc()["headline"])
    assert line == (
        "live (heldout prompts, T=0, concurrency 1): decode none 5.0 tok/s, ngram 10.0 tok/s, trained 20.0 tok/s; "
        "acceptance length trained 2.00, ngram 3.00; trained 4.00x vs none, 2.00x vs ngram"
    )
    assert summary_line({}) is None


def test_external_prompts_leave_out_the_runs_training_prompts(tmp_path):
    from eagle3.evaluate.prompts import MissingInput, external_prompts

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)] + [{"bad": 1}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    everything, info = external_prompts(str(path), 10, turns="last_turn", max_chars=1000, exclude=set())
    assert len(everything) == 6 and info["rejected"] == {"no_conversation": 1} and info["excluded_trained_on"] == 0
    trained_on = {everything[0]["id"], everything[3]["id"]}
    some, info = external_prompts(str(path), 10, turns="last_turn", max_chars=1000, exclude=trained_on)
    assert [p["id"] for p in some] == [p["id"] for p in everything if p["id"] not in trained_on]
    assert info["excluded_trained_on"] == 2 and "left out" in info["note"]
    assert len(external_prompts("builtin:demo_prompts", 5, turns="last_turn", max_chars=20000, exclude=set())[0]) == 5
    with pytest.raises(MissingInput, match="no usable prompt"):
        external_prompts(str(path), 3, turns="last_turn", max_chars=1000, exclude={p["id"] for p in everything})


def test_evaluate_config_knobs_validate():
    from eagle3.config import ConfigError, load_config

    ev = load_config(None, []).evaluate
    assert ev.methods == ["none", "ngram", "untrained", "trained"] and ev.prompt_sets == ["heldout", "external"]
    assert ev.concurrencies[0] == 1 and len(ev.concurrencies) == 2 and ev.rounds >= 2
    for bad in (
        "evaluate.ngram_prompt_lookup_min=5",
        "evaluate.concurrencies=[0]",
        'evaluate.methods=["eagle"]',
        "evaluate.methods=[]",
    ):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    cfg = load_config(None, ["evaluate.compare_untrained=false"])
    assert matrix.methods_of(cfg) == ["none", "ngram", "trained"]
    from eagle3.evaluate.servers import speculative_config

    assert speculative_config("ngram", cfg, {}) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert speculative_config("none", cfg, {}) is None


def test_cli_summary_prints_the_headline_line(tmp_path):
    from cli.main import _summary
    from eagle3.config import load_config
    from eagle3.manifest import record_stage
    from eagle3.results import StageCounts

    head = _doc()["headline"]
    entry = record_stage(
        tmp_path, "evaluate", StageCounts(12, 12), status="ok", headline=head, mean_acceptance_length={"0": 2.0}
    )
    text = _summary(load_config(None, [f'run_dir="{tmp_path}"']), {"evaluate": entry})
    assert "live acceptance length (vLLM): T=0: 2.000" in text
    assert (
        "live (heldout prompts, T=0, concurrency 1): decode none 5.0 tok/s, ngram 10.0 tok/s, trained 20.0 tok/s;"
        in text
    )


def test_compiled_variants_serve_without_enforce_eager_and_the_headline_divides_by_the_faster_baseline():
    from eagle3.config import ConfigError, load_config
    from eagle3.evaluate import servers
    from eagle3.evaluate.live import headline
    from eagle3.evaluate.table import markdown_table

    args = ["--enforce-eager", "--max-model-len", "2048"]
    assert servers.method_args("none_compiled", args) == ["--max-model-len", "2048"]
    assert servers.method_args("trained", args) == args
    cfg = load_config(
        None, ['server.args=["--enforce-eager"]', 'evaluate.methods=["none", "none_compiled", "trained_compiled"]']
    )
    drafters = {"trained": "/d/trained"}
    assert servers.speculative_config("none_compiled", cfg, drafters) is None
    assert servers.speculative_config("trained_compiled", cfg, drafters) == servers.speculative_config(
        "trained", cfg, drafters
    )
    with pytest.raises(ValueError, match="unknown evaluate method"):
        servers.speculative_config("ngram_eager", cfg, drafters)
    with pytest.raises(ConfigError, match="--enforce-eager"):
        load_config(None, ['server.args=["--max-model-len", "2048"]', 'evaluate.methods=["none", "none_compiled"]'])

    # none 5 tok/s eager, 8 compiled; trained 20 eager, 16 compiled; n-gram eager only (10)
    visits = [
        _visit("none", 0, None, 21, 4.0, [1]),
        _visit("none_compiled", 0, None, 21, 2.5, [2]),
        _visit("ngram", 0, _raw(2, 4, [2, 1, 1]), 21, 2.0, [1]),
        _visit("trained", 0, _raw(8, 8, [5, 2, 1]), 21, 1.0, [1]),
        _visit("trained_compiled", 0, _raw(8, 8, [5, 2, 1]), 21, 1.25, [2]),
    ]
    methods = ["none", "none_compiled", "ngram", "trained", "trained_compiled"]
    cells = {c["method"]: c for c in matrix.pool_cells(visits, methods)}
    assert (
        cells["none_compiled"]["mean_acceptance_length"] == 1.0
        and "definition" in cells["none_compiled"]["acceptance_source"]
    )
    assert cells["trained"]["speedup_vs_none"] == pytest.approx(4.0)
    assert cells["trained"]["speedup_vs_fastest_none"] == pytest.approx(20 / 8)
    assert cells["trained_compiled"]["speedup_vs_fastest_none"] == pytest.approx(16 / 8)
    # compiled and eager kernels may flip near-ties: a compiled method is checked against none_compiled
    assert (
        cells["trained_compiled"]["greedy_identical"] == 1
        and cells["trained_compiled"]["greedy_reference"] == "none_compiled"
    )
    assert (cells["trained"]["greedy_identical"], cells["trained"]["greedy_reference"]) == (1, "none")
    doc = {
        "cells": list(cells.values()),
        "num_speculative_tokens": 3,
        "max_tokens": 32,
        "rounds": 1,
        "servers": "restart",
        "decode_rate_definition": "d",
        "prompt_sets": {"heldout": {"label": "h", "selection": {}, "prompt_ids": ["a"]}},
    }
    head = headline(doc)
    assert head["speedup_fastest_vs_fastest_none"] == pytest.approx(20 / 8)
    assert (head["fastest_trained_method"], head["fastest_none_method"], head["fastest_ngram_method"]) == (
        "trained",
        "none_compiled",
        "ngram",
    )
    assert head["speedup_fastest_vs_fastest_ngram"] == pytest.approx(2.0)
    doc["headline"] = head
    assert "faster no-speculation server (none_compiled)" in markdown_table(doc)
    plain = {c["method"]: c for c in matrix.pool_cells(visits[:1] + visits[2:4], ["none", "ngram", "trained"])}
    assert plain["trained"]["speedup_vs_fastest_none"] is None
    assert "speedup_fastest_vs_fastest_none" not in headline({**doc, "cells": list(plain.values())})


def test_suffix_and_ngram_at_their_own_k_and_the_speedup_divides_by_the_fastest_free_method(tmp_path):
    from eagle3.config import load_config
    from eagle3.evaluate import servers

    cfg = load_config(
        None,
        [
            'server.args=["--enforce-eager"]',
            'server.model="tiny:qwen3"',
            'evaluate.methods=["none", "ngram", "suffix", "trained"]',
            "evaluate.num_speculative_tokens=3",
            "evaluate.ngram_num_speculative_tokens=5",
            'evaluate.suffix_python="/venvs/suffix/bin/python"',
        ],
    )
    assert servers.speculative_config("suffix", cfg, {}) == {"method": "suffix", "num_speculative_tokens": 5}
    assert servers.speculative_config("ngram", cfg, {})["num_speculative_tokens"] == 5
    assert servers.speculative_config("trained", cfg, {"trained": tmp_path})["num_speculative_tokens"] == 3
    plain = load_config(None, ['evaluate.methods=["ngram"]'])
    assert servers.speculative_config("ngram", plain, {})["num_speculative_tokens"] == 3  # equal K by default
    # suffix decoding is served by the interpreter that has arctic-inference; the rest by server.python
    facts = RunFacts.resolve(cfg)
    suffix = servers.make_server(facts, "suffix", {"method": "suffix"}, tmp_path / "s.log", None)
    none = servers.make_server(facts, "none", None, tmp_path / "n.log", None)
    assert suffix.argv[0] == "/venvs/suffix/bin/python" and none.argv[0] != "/venvs/suffix/bin/python"

    # none 5 tok/s, n-gram 10, suffix 12.5 (its compiled variant 14), trained 20: the best free is suffix_compiled
    visits = [
        _visit("none", 0, None, 21, 4.0, [1]),
        _visit("ngram", 0, _raw(2, 4, [2, 1, 1]), 21, 2.0, [1]),
        _visit("suffix", 0, _raw(2, 4, [2, 1, 1]), 21, 1.6, [1]),
        _visit("suffix_compiled", 0, _raw(2, 4, [2, 1, 1]), 21, 20 / 14, [1]),
        _visit("trained", 0, _raw(8, 8, [5, 2, 1]), 21, 1.0, [1]),
    ]
    methods = ["none", "ngram", "suffix", "suffix_compiled", "trained"]
    cells = {c["method"]: c for c in matrix.pool_cells(visits, methods)}
    assert cells["trained"]["speedup_vs_best_free"] == pytest.approx(20 / 14)
    assert cells["ngram"]["speedup_vs_best_free"] == pytest.approx(10 / 14)
    ratio = matrix.best_free_ratio(cells)
    assert ratio == {
        "speedup_vs_best_free": pytest.approx(20 / 14),
        "best_free_method": "suffix_compiled",
        "fastest_trained_method": "trained",
    }
    assert matrix.best_free_ratio({k: v for k, v in cells.items() if k != "trained"}) == {}
