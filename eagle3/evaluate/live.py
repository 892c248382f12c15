"""Stage ``evaluate``: the trained drafter served by vLLM next to the alternatives a user has.

Design choices:
- The stage measures a table (see matrix.py): no speculation, vLLM's n-gram speculator, an
  untrained drafter and the trained drafter (``evaluate.methods``), on labelled prompt sets
  (prompts.py: the run's held-out split; prompts the target did not write), at each
  temperature and concurrency, in alternating rounds. Every figure names its prompt set.
- Decode tokens/s is defined once, in measure.py; acceptance comes from vLLM's own counters
  (metrics.py). The speed-up over no speculation is the headline: acceptance lengths of
  different speculators are not counted alike (n-gram's only counts the steps it proposed).
- ``measure_live(facts, drafter_dir, out_dir=...)`` returns the whole table as a dict; the
  stage (``run_evaluate``) writes it to RUN/evaluate/live.json, records the manifest entry and
  fails loudly when a cell got no answer or a drafter never drafted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import atomic_write_json, read_json
from eagle3.errors import MissingInputError, run_first
from eagle3.evaluate import matrix, servers
from eagle3.evaluate.errors import EvaluationFailed
from eagle3.evaluate.measure import DECODE_RATE_DEFINITION
from eagle3.evaluate.metrics import fetch_metrics, metrics_delta, parse_spec_metrics  # noqa: F401  (re-exported)
from eagle3.evaluate.prompts import MissingInput, prompt_sets, select_prompts  # noqa: F401  (re-exported)
from eagle3.layout import RunLayout
from eagle3.manifest import record_stage, versions
from eagle3.results import StageCounts
from eagle3.run_facts import RunFacts

STAGE = "evaluate"


def temperatures(config: PipelineConfig) -> list[float]:
    return matrix.temperatures(config)


def _drafters(facts: RunFacts, methods: list[str], drafter_dir, out: Path, logger) -> dict[str, Path]:
    if not any(m in servers.DRAFTER_METHODS for m in methods):
        return {}
    if drafter_dir is None or not (Path(drafter_dir) / "config.json").exists():
        needed = [m for m in methods if m in servers.DRAFTER_METHODS]
        problem = f"holds no exported drafter (config.json), which methods {needed} need"
        raise MissingInputError(STAGE, drafter_dir, run_first("eagle3 export"), problem)
    found = {"trained": Path(drafter_dir)}
    if any(servers.base_method(m) == "untrained" for m in methods):
        found["untrained"] = servers.build_untrained(facts, Path(drafter_dir), out, logger)
    return found


def headline(doc: dict, temperature: float | None = None) -> dict:
    """The figures a reader asks for first: held-out prompts (else the first set), lowest concurrency,
    temperature 0 (else the first measured) unless ``temperature`` is given."""
    temps = [c["temperature"] for c in doc["cells"]]
    if temperature is None:
        temperature = 0.0 if 0.0 in temps else (temps[0] if temps else 0.0)
    cells = [c for c in doc["cells"] if c["temperature"] == temperature]
    if not cells:
        return {}
    sets = list(dict.fromkeys(c["prompt_set"] for c in cells))
    where = {
        "prompt_set": next((s for s in ("suite", "heldout") if s in sets), sets[0]),
        "temperature": temperature,
        "concurrency": min(c["concurrency"] for c in cells),
    }
    by = {c["method"]: c for c in cells if all(c[k] == v for k, v in where.items())}
    get = lambda m, k: (by.get(m) or {}).get(k)  # noqa: E731
    return {
        **where,
        "num_speculative_tokens": doc["num_speculative_tokens"],
        **{
            f"acceptance_length_{m}": get(m, "mean_acceptance_length")
            for m in ("trained", "untrained", "ngram", "suffix")
        },
        "decode_tokens_per_s": {m: c["decode_tokens_per_s"] for m, c in by.items()},
        "speedup_vs_none": get("trained", "speedup_vs_none"),
        "speedup_vs_ngram": get("trained", "speedup_vs_ngram"),
        "tokens_per_step": {
            m: t["pooled"]["acceptance_length"]
            for m, t in (doc.get("acceptance") or {}).get(where["prompt_set"], {}).items()
        },
        "tokens_per_step_ci95": {
            m: t["pooled"]["ci95"] for m, t in (doc.get("acceptance") or {}).get(where["prompt_set"], {}).items()
        },
        **matrix.fastest_ratios(by),
        **matrix.best_free_ratio(by),
    }


def measure_live(facts: RunFacts, drafter_dir: str | Path | None, *, out_dir: str | Path, logger=None) -> dict:
    """The live comparison table as a dict (what RUN/evaluate/live.json holds).

    ``facts``: the run's, whose target every server serves. ``drafter_dir``: the trained drafter in the
    vllm (EAGLE) layout, or None when no drafter method is measured. ``out_dir``: server logs and the
    untrained drafter go there."""
    config = facts.config
    log = logger or logging.getLogger(__name__)
    ev, out = config.evaluate, Path(out_dir)
    servers.check_server_args(config.server.args)
    if config.server.mode == "external":
        log.warning("evaluate starts its own vLLM servers (server.python/command) even though server.mode=external")
    methods = matrix.methods_of(config)
    if not methods:
        raise ValueError("evaluate.methods is empty (or holds only untrained with evaluate.compare_untrained=false)")
    sets = prompt_sets(config, list(dict.fromkeys(ev.prompt_sets)))
    for name, info in sets.items():
        if info["selection"].get("note"):
            log.warning("evaluate prompt set %s: %s", name, info["selection"]["note"])
    drafters = _drafters(facts, methods, drafter_dir, out, log)
    specs = {m: servers.speculative_config(m, config, drafters) for m in methods}
    began = time.monotonic()
    visits, starts = matrix.run_matrix(facts, specs, sets, out, log)
    doc = {
        "target": config.server.model,
        "drafter": str(Path(drafter_dir).resolve()) if drafter_dir else None,
        "methods": {
            m: {"speculative_config": specs[m], "acceptance_source": matrix.ACCEPTANCE_SOURCE[servers.base_method(m)]}
            for m in methods
        },
        "num_speculative_tokens": ev.num_speculative_tokens,
        "max_tokens": ev.max_tokens,
        "rounds": ev.rounds,
        "servers": ev.servers,
        "server_starts": starts,
        "seconds": round(time.monotonic() - began, 1),
        "decode_rate_definition": DECODE_RATE_DEFINITION,
        "prompt_sets": {
            n: {"label": s["label"], "selection": s["selection"], "prompt_ids": [p["id"] for p in s["prompts"]]}
            for n, s in sets.items()
        },
        "cells": matrix.pool_cells(visits, methods),
        "visits": [{k: v for k, v in visit.items() if k != "token_ids"} for visit in visits],
    }
    doc["acceptance"] = acceptance_tables(visits, sets)
    doc["headline"] = headline(doc)
    return doc


def acceptance_tables(visits: list[dict], sets: dict[str, dict]) -> dict:
    """{prompt set: {method: tokens per target step pooled and per category, with bootstrap intervals}} from
    the first round's visits at temperature 0 and concurrency 1, where each prompt's counters were read on
    their own (eagle3/evaluate/intervals.py). Greedy answers are the same every round, so one round is the
    whole sample; a suite prompt's category is its own, any other set is one category named after the set."""
    from eagle3.evaluate.intervals import by_category

    out: dict[str, dict] = {}
    for v in visits:
        if v.get("per_prompt") is None or v["temperature"] != 0 or v["round"] != 0:
            continue
        category_of = {p["id"]: p.get("category", v["prompt_set"]) for p in sets[v["prompt_set"]]["prompts"]}
        out.setdefault(v["prompt_set"], {})[v["method"]] = by_category(v["per_prompt"], category_of)
    return out


# -- the stage ------------------------------------------------------------------------------


def offline_estimate(run_dir: str | Path) -> dict | None:
    """The last line of training's held-out evaluation (RUN/train/eval.jsonl), if any."""
    import json

    path = RunLayout.of(run_dir).train_eval
    if not path.exists():
        return None
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
        value = last.get("acceptance_length")
        return {
            "acceptance_length": float(value) if value is not None else None,
            "step": last.get("step"),
            "path": str(path),
        }
    except (ValueError, TypeError, AttributeError) as exc:
        return {"acceptance_length": None, "path": str(path), "error": f"last line unreadable: {exc}"}


def problems(cells: list[dict]) -> list[str]:
    """Cells whose result must not be used: nothing answered, or a drafter never drafted."""
    bad = []
    for c in cells:
        where = f"{c['method']} {c['prompt_set']} T={c['temperature']:g} c={c['concurrency']}"
        if not c["requests_ok"]:
            bad.append(f"{where}: no request succeeded")
        elif c["method"] in servers.DRAFTER_METHODS and not (c["counters"] or {}).get("drafts"):
            bad.append(f"{where}: vLLM made no drafts (speculative decoding not engaged)")
    return bad


def _by_temperature(cells: list[dict], method: str, key: str, where: dict) -> dict | None:
    rows = {
        f"{c['temperature']:g}": c[key]
        for c in cells
        if c["method"] == method and all(c[k] == v for k, v in where.items())
    }
    return rows or None


def run_evaluate(facts: RunFacts, logger=None) -> dict:
    """Measure RUN/export/vllm live (the servers serve the run's target, from the facts); write
    RUN/evaluate/live.json and the manifest entry."""
    config, layout = facts.config, facts.layout
    drafter = layout.export_layout("vllm")
    wants_drafter = any(m in servers.DRAFTER_METHODS for m in matrix.methods_of(config))
    if wants_drafter and not (drafter / "config.json").exists():
        hint = "run `eagle3 export` first (export.formats must include vllm)"
        raise MissingInputError(STAGE, drafter, hint, "holds no exported drafter")
    out = layout.evaluate
    doc = measure_live(facts, drafter if wants_drafter else None, out_dir=out, logger=logger)
    info_path = drafter / "export_info.json"
    doc.update(
        {
            "export_info": read_json(info_path) if info_path.exists() else None,
            "offline_estimate": offline_estimate(layout.root),
            "evaluate_config": config.evaluate.model_dump(mode="json"),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    atomic_write_json(layout.live, doc)
    cells, head = doc["cells"], doc["headline"]
    errors = Counter()
    for c in cells:
        errors.update(c["errors"])
    bad = problems(cells)
    where = {k: head.get(k) for k in ("prompt_set", "concurrency")}
    counts = StageCounts(
        sum(c["requests"] for c in cells),
        sum(c["requests_ok"] for c in cells),
        sum(c["requests_failed"] for c in cells),
        0,
        dict(errors),
    )
    entry = record_stage(
        layout.root,
        STAGE,
        counts,
        status="failed" if bad else "ok",
        error="; ".join(bad) or None,
        path=str(layout.live),
        headline=head,
        headline_all_temperatures={f"{t:g}": headline(doc, t) for t in matrix.temperatures(config)},
        mean_acceptance_length=_by_temperature(cells, "trained", "mean_acceptance_length", where),
        acceptance_rate=_by_temperature(cells, "trained", "acceptance_rate", where),
        untrained_mean_acceptance_length=_by_temperature(cells, "untrained", "mean_acceptance_length", where),
        offline_acceptance_length=(doc["offline_estimate"] or {}).get("acceptance_length"),
        prompt_sets={n: s["selection"] for n, s in doc["prompt_sets"].items()},
        config_hash=section_hash(config.evaluate),
        versions=versions("httpx"),
    )
    if bad:
        raise EvaluationFailed(f"evaluate: {'; '.join(bad)}; see {layout.live} and the server logs in {out}")
    return {**entry, "live": doc}


def summary_line(entry: dict, run_dir: str | Path) -> str | None:
    """The CLI's end-of-run lines for this stage: live acceptance per temperature, then the headline."""
    from eagle3.evaluate.table import summary_line as headline_line

    def per_temperature(key: str) -> str:
        return ", ".join(f"T={t}: {v:.3f}" for t, v in (entry.get(key) or {}).items() if v is not None)

    lines = []
    live, base = per_temperature("mean_acceptance_length"), per_temperature("untrained_mean_acceptance_length")
    if live:
        lines.append(
            f"live acceptance length (vLLM): {live}"
            + (f"; untrained drafter {base}" if base else "")
            + f"  ({Path(run_dir) / 'evaluate' / 'live.json'})"
        )
    line = headline_line(entry.get("headline"))
    if line:
        lines.append(line)
    return "\n".join(lines) or None
