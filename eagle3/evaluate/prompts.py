"""The labelled prompt sets live evaluation measures on.

Design choices:
- ``heldout``: the run's own prompts that training held out (``train.eval_fraction``, by id
  hash as training uses), so the drafter is measured on conversations it never trained on.
  When fewer exist than ``evaluate.num_prompts``, the rest is topped up from the training
  prompts in a fixed hash order and the selection says so.
- ``external``: prompts from another source (``evaluate.external_prompts``, by default the
  shipped human-written demo prompts), read through prepare's normaliser so the same schemas
  and rules apply. When the run's prompts came from a model (the target writing its own user
  turns), this set shows how the drafter does on differently styled prompts. Prompt ids are
  content hashes, so an external prompt that was also one of the run's *training* prompts is
  recognised and left out (counted): the set is never flattered by training data.
- ``suite``: the fixed evaluation suite (``evaluate.suite``, by default the shipped
  ``builtin:eval_suite``: prompts written for this project in labelled categories, stable ids),
  the same on every run and machine, so two runs' figures can be compared. Its prompts carry
  their category; ``evaluate.suite_per_category`` takes the first N of each category (a fixed
  subset, for quick runs). Its ids are never checked against training data: a run that trains
  on the suite's own prompts is the user's choice, and the report says which suite was used.
- Every set carries a label, its source and the ids used, so each acceptance figure names
  the prompts it was measured on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3.errors import MissingInputError, run_first
from eagle3.layout import RunLayout

PROMPT_SETS = ("suite", "heldout", "external")


# The prompts this stage measures on are missing (a stage it reads has not run, or no usable one).
MissingInput = MissingInputError


def _order(sample_id: str) -> str:
    return hashlib.sha256(f"eagle3-evaluate-order:{sample_id}".encode()).hexdigest()


def _run_prompts(run_dir: str | Path) -> list[dict]:
    import pyarrow.parquet as pq

    folder = RunLayout.of(run_dir).prompts
    shards = sorted(folder.glob("shard-*.parquet"))
    if not shards:
        raise MissingInputError(
            "evaluate", folder, run_first("eagle3 prepare"), "holds no prompt shards (shard-*.parquet)"
        )
    rows, seen = [], set()
    for shard in shards:
        for row in pq.read_table(shard, columns=["id", "messages"]).to_pylist():
            if row["id"] not in seen:
                seen.add(row["id"])
                rows.append(
                    {
                        "id": row["id"],
                        "messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                    }
                )
    return sorted(rows, key=lambda r: _order(r["id"]))


def select_prompts(run_dir: str | Path, fraction: float, num_prompts: int) -> tuple[list[dict], dict]:
    """Up to ``num_prompts`` held-out prompts (id, messages), topped up from the rest if needed."""
    from eagle3.train.split import is_heldout

    rows = _run_prompts(run_dir)
    heldout = [r for r in rows if is_heldout(r["id"], fraction)]
    chosen = heldout[:num_prompts]
    top_up = [r for r in rows if not is_heldout(r["id"], fraction)][: num_prompts - len(chosen)]
    info = {
        "prompts_available": len(rows),
        "heldout_available": len(heldout),
        "heldout_used": len(chosen),
        "topped_up_from_training": len(top_up),
        "eval_fraction": fraction,
        "requested": num_prompts,
    }
    if top_up:
        info["note"] = (
            f"only {len(heldout)} held-out prompts exist (train.eval_fraction={fraction}); "
            f"{len(top_up)} training prompts were added, which flatters acceptance"
        )
    return chosen + top_up, info


def training_ids(run_dir: str | Path, fraction: float) -> set[str]:
    """Ids of the run's prompts that training used (not held out); empty when the run has none."""
    from eagle3.train.split import is_heldout

    try:
        return {r["id"] for r in _run_prompts(run_dir) if not is_heldout(r["id"], fraction)}
    except MissingInput:
        return set()


def external_prompts(
    spec: str, num_prompts: int, *, turns: str, max_chars: int, exclude: set[str]
) -> tuple[list[dict], dict]:
    """Up to ``num_prompts`` prompts of ``spec`` (a file, folder or builtin:NAME) in a fixed hash
    order, minus the ids in ``exclude``; rows the normaliser rejects are counted by reason."""
    from collections import Counter

    from eagle3.prepare.normalize import Rejected, candidates
    from eagle3.prepare.sources import Source, SourceError

    source = Source(spec)
    if source.files is None:
        raise SourceError(f"evaluate.external_prompts {spec!r}: not a local file, folder or builtin: source")
    rejected: Counter = Counter()
    found: dict[str, dict] = {}
    for row in source.rows():
        for cand in [row.value] if isinstance(row.value, Rejected) else candidates(row.value, turns, max_chars):
            if isinstance(cand, Rejected):
                rejected[cand.kind] += 1
            else:
                found.setdefault(cand.id, {"id": cand.id, "messages": cand.as_messages()})
    usable = [p for p in sorted(found.values(), key=lambda p: _order(p["id"])) if p["id"] not in exclude]
    chosen = usable[:num_prompts]
    info = {
        "source": spec,
        "prompts_available": len(found),
        "rejected": dict(rejected),
        "excluded_trained_on": len(found) - len(usable),
        "used": len(chosen),
        "requested": num_prompts,
    }
    if info["excluded_trained_on"]:
        info["note"] = (
            f"{info['excluded_trained_on']} of the {len(found)} prompts in {spec} were training prompts of "
            "this run and were left out"
        )
    if not chosen:
        problem = (
            f"(evaluate.external_prompts) holds no usable prompt (found {len(found)}, "
            f"{info['excluded_trained_on']} were training prompts of this run, rejected {dict(rejected)})"
        )
        hint = "point evaluate.external_prompts at prompts this run did not train on"
        raise MissingInputError("evaluate", spec, hint, problem)
    return chosen, info


def suite_prompts(spec: str, per_category: int | None) -> tuple[list[dict], dict]:
    """The suite's prompts in file order (each with its category), the first ``per_category`` of each
    category when given; and the selection info (source, fingerprint, counts per category)."""
    from eagle3.evaluate.suite import categories, load_suite, suite_fingerprint

    everything = load_suite(spec)
    chosen = []
    for rows in categories(everything).values():
        chosen += rows if per_category is None else rows[:per_category]
    order = {p["id"]: i for i, p in enumerate(everything)}
    chosen.sort(key=lambda p: order[p["id"]])
    info = {
        "source": spec,
        "fingerprint": suite_fingerprint(everything),
        "prompts_in_suite": len(everything),
        "used": len(chosen),
        "per_category": {c: len(rs) for c, rs in categories(chosen).items()},
    }
    return chosen, info


def prompt_sets(config, names: list[str]) -> dict[str, dict]:
    """{name: {"label", "prompts", "selection"}} for each requested set."""
    ev, run = config.evaluate, config.run_dir
    out = {}
    for name in names:
        if name == "suite":
            prompts, info = suite_prompts(ev.suite, ev.suite_per_category)
            cats = len(info["per_category"])
            label = f"the fixed evaluation suite {ev.suite} ({info['used']} prompts, {cats} categories)"
        elif name == "heldout":
            prompts, info = select_prompts(run, config.train.eval_fraction, ev.num_prompts)
            label = (
                f"held-out split of this run's prompts (data.source {config.data.source}; train.eval_fraction "
                f"{config.train.eval_fraction})"
            )
        else:
            exclude = training_ids(run, config.train.eval_fraction)
            prompts, info = external_prompts(
                ev.external_prompts,
                ev.num_prompts,
                turns=config.data.turns,
                max_chars=config.data.max_prompt_chars,
                exclude=exclude,
            )
            label = (
                f"prompts from {ev.external_prompts}, not written by the target; this run's training prompts left out"
            )
        out[name] = {"label": label, "prompts": prompts, "selection": info}
    return out
