"""The live comparison: methods x prompt sets x temperatures x concurrencies, in alternating rounds.

Design choices:
- A *cell* is (prompt set, temperature, concurrency); a *visit* sends every prompt of the
  cell's set once to one method's server. Every method sees the same prompts with the same
  max_tokens. Visits come in ``evaluate.rounds`` rounds; each round visits every method for
  every cell, the method order rotated by one per round, so slow drift of the machine (other
  load, thermal state) falls on every method alike instead of on whichever ran last.
- ``evaluate.servers``: ``side_by_side`` starts each method's server once and keeps them all
  up (only the one being measured gets requests), interleaving methods per cell: the fastest
  alternation, at the memory of one server per method. ``restart`` runs one server at a time
  and restarts per round (each round measures every cell of a method, then moves on): fits any
  machine that holds one server, at the cost of methods x rounds starts.
- A cell's figures pool its rounds: decode tokens/s = pooled decode tokens / pooled decode
  time (see measure.py), acceptance from the summed raw counters. Per-round values are kept,
  with their spread, so the reader sees how much of a difference is noise.
- Acceptance per method: vLLM's counters differenced around each visit (one server per
  method, so nothing else moves them). No speculation has acceptance length 1 by definition
  (one token per target step; vLLM exports no spec-decode counters then). The n-gram
  speculator's counters count only steps in which it found a match and proposed tokens, so
  its acceptance length is not comparable with a drafter's, which proposes every step: the
  raw counters are recorded and the decode-rate speed-up is the headline.
- At temperature 0 every method must produce the target's greedy answer (speculative
  decoding is lossless): each visit's token ids are compared with the reference method's
  (``none`` when measured; ``none_compiled`` for a compiled method) and the counts of identical
  answers are recorded. At concurrency above 1 batched kernels may legitimately flip near-tied
  tokens, and compiled kernels differ from eager ones, so that check is reported, not enforced.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from functools import reduce
from pathlib import Path

from eagle3.evaluate import measure, metrics, servers
from eagle3.run_facts import RunFacts

ACCEPTANCE_SOURCE = {
    "none": "1 by definition: no speculation, one token per target step",
    "ngram": "vLLM spec-decode counters; counts only steps where n-gram found a match and proposed tokens",
    "suffix": "vLLM spec-decode counters; counts only steps where suffix decoding proposed tokens",
    "untrained": "vLLM spec-decode counters",
    "trained": "vLLM spec-decode counters",
}


def rotated(methods: list[str], round_index: int) -> list[str]:
    k = round_index % len(methods)
    return methods[k:] + methods[:k]


def visit_order(methods: list[str], cells: list[tuple], rounds: int, strategy: str) -> list[tuple[int, str, tuple]]:
    """(round, method, cell) in the order they are measured."""
    order = []
    for r in range(rounds):
        ms = rotated(methods, r)
        pairs = (
            ((m, c) for c in cells for m in ms) if strategy == "side_by_side" else ((m, c) for m in ms for c in cells)
        )
        order += [(r, m, c) for m, c in pairs]
    return order


def methods_of(config) -> list[str]:
    ev = config.evaluate
    return [m for m in dict.fromkeys(ev.methods) if ev.compare_untrained or servers.base_method(m) != "untrained"]


def temperatures(config) -> list[float]:
    temps = config.evaluate.temperatures
    temps = [0.0, config.generation.temperature] if temps is None else temps
    return list(dict.fromkeys(float(t) for t in temps))


def request_timeout_s(config) -> float:
    gen = config.generation
    if gen.request_timeout_s is not None:
        return gen.request_timeout_s
    return gen.deadline_base_s + config.evaluate.max_tokens / gen.min_tokens_per_s


class ServerSet:
    """The servers of the methods, started and stopped as ``strategy`` says; always stopped on exit."""

    def __init__(self, facts: RunFacts, specs: dict[str, dict | None], out: Path, warm_prompt: dict, logger):
        self.facts, self.config = facts, facts.config
        self.specs, self.out, self.warm_prompt, self.log = specs, out, warm_prompt, logger
        self.strategy = self.config.evaluate.servers
        self.running: dict[str, object] = {}
        self.starts: list[dict] = []
        self._current: tuple[int, str] | None = None

    def get(self, round_index: int, method: str):
        if self.strategy == "restart" and self._current != (round_index, method):
            self.close()
        self._current = (round_index, method)
        if method not in self.running:
            self.running[method] = self._start(round_index, method)
        return self.running[method]

    def others(self, method: str) -> list:
        return [s for m, s in self.running.items() if m != method]

    def _start(self, round_index: int, method: str):
        managed = servers.make_server(
            self.facts, method, self.specs[method], self.out / f"server-{method}.log", self.log
        )
        began = time.monotonic()
        managed.start()
        try:
            servers.warm_up(managed, self.warm_prompt, request_timeout_s(self.config))
        except BaseException:
            managed.stop_quietly()
            raise
        self.starts.append({"method": method, "round": round_index, "start_s": round(time.monotonic() - began, 1)})
        return managed

    def close(self) -> None:
        while self.running:
            self.running.popitem()[1].stop_quietly()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cpu(servers_: list) -> float | None:
    values = [servers.group_cpu_seconds(s) for s in servers_]
    return None if any(v is None for v in values) else sum(values)


def _batch(managed, prompts: list[dict], temperature: float, concurrency: int, config):
    return measure.run_batch(
        managed.base_url,
        managed.api_key,
        managed.served_model_name,
        prompts,
        temperature=temperature,
        top_p=config.generation.top_p,
        max_tokens=config.evaluate.max_tokens,
        concurrency=concurrency,
        timeout_s=request_timeout_s(config),
    )


def _one_at_a_time(managed, prompts: list[dict], temperature: float, config, probe, before: dict):
    """Concurrency 1, the counters read between requests: each prompt's own drafts and accepted tokens
    (nothing else runs on the server, so a delta is that request's). (outcomes, wall, per-prompt rows, last read)."""
    outcomes, rows, wall = [], [], 0.0
    for prompt in prompts:
        [outcome], seconds = _batch(managed, [prompt], temperature, 1, config)
        after = metrics.fetch_metrics(probe, managed.root_url, managed.api_key)
        delta = metrics.raw_delta(before, after) if after["found"] else None
        outcomes.append(outcome)
        wall += seconds
        rows.append(per_prompt_row(prompt["id"], outcome, delta))
        before = after
    return outcomes, wall, rows, before


def per_prompt_row(prompt_id: str, outcome, delta: dict | None) -> dict:
    """One request's counts: completion tokens, vLLM's drafts and accepted draft tokens (0 without speculation)."""
    return {
        "id": prompt_id,
        "ok": outcome.error is None,
        "completion_tokens": len(outcome.token_ids) if outcome.error is None else 0,
        "drafts": (delta or {}).get("drafts", 0),
        "accepted_tokens": (delta or {}).get("accepted_tokens", 0),
    }


def _visit(managed, others: list, prompts: list[dict], cell: tuple, config, probe) -> tuple[dict, list]:
    """Measure one method on one cell: stats, counter delta, CPU, token ids per prompt; at concurrency 1
    also each prompt's own counters (``per_prompt``), which the suite's intervals are computed from."""
    _, temperature, concurrency = cell
    before = metrics.fetch_metrics(probe, managed.root_url, managed.api_key)
    cpu0, idle0 = _cpu([managed]), _cpu(others)
    rows = None
    if concurrency == 1:
        outcomes, wall, rows, after = _one_at_a_time(managed, prompts, temperature, config, probe, before)
        managed.check()
    else:
        outcomes, wall = _batch(managed, prompts, temperature, concurrency, config)
        managed.check()
        after = metrics.fetch_metrics(probe, managed.root_url, managed.api_key)
    cpu1, idle1 = _cpu([managed]), _cpu(others)
    record = {
        "stats": measure.summarize(outcomes, wall),
        "counters": metrics.raw_delta(before, after) if after["found"] else None,
        "server_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2),
        "idle_servers_cpu_s": None if not others or idle0 is None or idle1 is None else round(idle1 - idle0, 2),
        "per_prompt": rows,
    }
    ids = [None if o.error else o.token_ids for o in outcomes]
    return record, ids


def _digest(ids: list[int] | None) -> str | None:
    return None if ids is None else hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def run_matrix(
    facts: RunFacts, specs: dict[str, dict | None], sets: dict[str, dict], out: Path, logger
) -> tuple[list[dict], list[dict]]:
    """Every visit, in alternation order; (visit records, server starts)."""
    config = facts.config
    ev = config.evaluate
    methods = list(specs)
    cells = list(itertools.product(list(sets), temperatures(config), list(dict.fromkeys(ev.concurrencies))))
    warm = next(iter(sets.values()))["prompts"][0]
    visits = []
    with ServerSet(facts, specs, out, warm, logger) as pool, servers.metrics_client() as probe:
        for round_index, method, cell in visit_order(methods, cells, ev.rounds, ev.servers):
            managed = pool.get(round_index, method)
            prompts = sets[cell[0]]["prompts"]
            record, ids = _visit(managed, pool.others(method), prompts, cell, config, probe)
            stats = record["stats"]
            logger.info(
                "evaluate round %d %s %s T=%g c=%d: %d/%d ok, %.1f decode tokens/s%s",
                round_index,
                method,
                cell[0],
                cell[1],
                cell[2],
                stats["requests_ok"],
                stats["requests"],
                measure.rates(stats)["decode_tokens_per_s"] or 0.0,
                ""
                if record["counters"] is None
                else f", acceptance length {metrics.with_rates(record['counters'])['mean_acceptance_length']}",
            )
            visits.append(
                {
                    "round": round_index,
                    "method": method,
                    "prompt_set": cell[0],
                    "temperature": cell[1],
                    "concurrency": cell[2],
                    **record,
                    "token_ids": ids,
                    "outputs": {p["id"]: _digest(i) for p, i in zip(prompts, ids)},
                }
            )
        starts = pool.starts
    return visits, starts


# -- pooling visits into cells ---------------------------------------------------------------


def _spread(values: list[float | None]) -> dict:
    xs = [v for v in values if v is not None]
    if not xs:
        return {"min": None, "max": None, "relative": None}
    mean = sum(xs) / len(xs)
    return {"min": min(xs), "max": max(xs), "relative": (max(xs) - min(xs)) / mean if mean else None}


def _acceptance(method: str, counters: dict | None) -> dict:
    if servers.base_method(method) == "none":
        return {"mean_acceptance_length": 1.0, "acceptance_rate": None, "per_position_acceptance": [], "counters": None}
    if counters is None:
        return {
            "mean_acceptance_length": None,
            "acceptance_rate": None,
            "per_position_acceptance": [],
            "counters": None,
        }
    full = metrics.with_rates(counters)
    return {
        "mean_acceptance_length": full["mean_acceptance_length"],
        "acceptance_rate": full["acceptance_rate"],
        "per_position_acceptance": full["per_position_acceptance"],
        "counters": counters,
    }


def pool_cell(method: str, visits: list[dict]) -> dict:
    """One cell of one method from its visits (its rounds)."""
    stats = reduce(measure.add_stats, [v["stats"] for v in visits])
    found = [v["counters"] for v in visits if v["counters"] is not None]
    counters = reduce(metrics.add_raw, found) if found else None
    rounds = [
        {
            "round": v["round"],
            "decode_tokens_per_s": measure.rates(v["stats"])["decode_tokens_per_s"],
            "mean_acceptance_length": _acceptance(method, v["counters"])["mean_acceptance_length"],
            "server_cpu_s": v["server_cpu_s"],
            "idle_servers_cpu_s": v["idle_servers_cpu_s"],
        }
        for v in visits
    ]
    return {
        **stats,
        **measure.rates(stats),
        **_acceptance(method, counters),
        "acceptance_source": ACCEPTANCE_SOURCE[servers.base_method(method)],
        "rounds": rounds,
        "decode_tokens_per_s_spread": _spread([r["decode_tokens_per_s"] for r in rounds]),
    }


def _greedy(visits: list[dict], reference: dict[tuple, list]) -> dict:
    """Answers identical to the reference method's answer of round 0, over every round."""
    identical = compared = 0
    for v in visits:
        ref = reference.get((v["prompt_set"], v["temperature"], v["concurrency"]))
        for mine, theirs in zip(v["token_ids"], ref or []):
            if mine is not None and theirs is not None:
                compared += 1
                identical += mine == theirs
    return {"greedy_identical": identical, "greedy_compared": compared}


def greedy_reference(method: str, methods: list[str]) -> str:
    """The method whose greedy answers ``method``'s must equal: no speculation in the same graph mode
    (compiled and eager kernels may legitimately flip near-tied tokens), else plain ``none``, else the first."""
    if servers.is_compiled(method) and "none_compiled" in methods:
        return "none_compiled"
    return "none" if "none" in methods else methods[0]


def pool_cells(visits: list[dict], methods: list[str]) -> list[dict]:
    """Cells in (prompt set, temperature, concurrency, method) order, with speed-ups and the greedy check."""
    references = {
        ref: {
            (v["prompt_set"], v["temperature"], v["concurrency"]): v["token_ids"]
            for v in visits
            if v["method"] == ref and v["round"] == 0 and v["temperature"] == 0
        }
        for ref in {greedy_reference(m, methods) for m in methods}
    }
    keys = list(dict.fromkeys((v["prompt_set"], v["temperature"], v["concurrency"]) for v in visits))
    cells = []
    for key in keys:
        group = {}
        for m in methods:
            mine = [
                v for v in visits if (v["prompt_set"], v["temperature"], v["concurrency"]) == key and v["method"] == m
            ]
            if mine:
                group[m] = {
                    "method": m,
                    "prompt_set": key[0],
                    "temperature": key[1],
                    "concurrency": key[2],
                    **pool_cell(m, mine),
                    **(_greedy(mine, references[greedy_reference(m, methods)]) if key[1] == 0 else {}),
                    **({"greedy_reference": greedy_reference(m, methods)} if key[1] == 0 else {}),
                }
        for cell in group.values():
            rate = cell["decode_tokens_per_s"]
            for base in ("none", "ngram"):
                other = (group.get(base) or {}).get("decode_tokens_per_s")
                cell[f"speedup_vs_{base}"] = rate / other if rate and other else None
            fastest = fastest_rate(group, "none")
            cell["speedup_vs_fastest_none"] = (
                rate / fastest if rate and fastest and len(variants(group, "none")) > 1 else None
            )
            free = best_free_cell(group)
            cell["speedup_vs_best_free"] = rate / free["decode_tokens_per_s"] if rate and free else None
        cells += group.values()
    return cells


def variants(group: dict[str, dict], base: str) -> list[dict]:
    """The measured cells of ``base`` and its compiled variant."""
    return [group[m] for m in (base, base + servers.COMPILED) if m in group]


def best_free_cell(group: dict[str, dict]) -> dict | None:
    """The fastest of the methods a user has without training (no speculation, n-gram, suffix decoding), in
    either graph mode, of those measured."""
    free = [c for b in servers.FREE_METHODS for c in variants(group, b) if c["decode_tokens_per_s"]]
    return max(free, key=lambda c: c["decode_tokens_per_s"], default=None)


def fastest_rate(group: dict[str, dict], base: str) -> float | None:
    rates = [c["decode_tokens_per_s"] for c in variants(group, base) if c["decode_tokens_per_s"]]
    return max(rates) if rates else None


def fastest_ratios(group: dict[str, dict]) -> dict:
    """When compiled variants were measured: the faster trained server over the faster no-speculation
    (and n-gram) server, each in whichever graph mode served it faster, naming the modes."""
    if not any(servers.is_compiled(m) for m in group):
        return {}
    out = {}
    best = {
        b: max(variants(group, b), key=lambda c: c["decode_tokens_per_s"] or 0.0, default=None)
        for b in ("trained", "none", "ngram")
    }
    top = best["trained"]
    for base in ("none", "ngram"):
        other = best[base]
        ok = top and other and top["decode_tokens_per_s"] and other["decode_tokens_per_s"]
        out[f"speedup_fastest_vs_fastest_{base}"] = (
            top["decode_tokens_per_s"] / other["decode_tokens_per_s"] if ok else None
        )
        out[f"fastest_{base}_method"] = other["method"] if other else None
    out["fastest_trained_method"] = top["method"] if top else None
    return out


def best_free_ratio(group: dict[str, dict]) -> dict:
    """The fastest trained server (either graph mode) over the fastest free method (none, n-gram, suffix;
    either mode), naming both: the speed-up a user gets for training a drafter."""
    best = best_free_cell(group)
    top = max(variants(group, "trained"), key=lambda c: c["decode_tokens_per_s"] or 0.0, default=None)
    if best is None or top is None or not top["decode_tokens_per_s"]:
        return {}
    return {
        "speedup_vs_best_free": top["decode_tokens_per_s"] / best["decode_tokens_per_s"],
        "best_free_method": best["method"],
        "fastest_trained_method": top["method"],
    }
