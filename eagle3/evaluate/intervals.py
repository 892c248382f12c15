"""Acceptance per prompt, pooled per category and over a suite, with bootstrap intervals.

Design choices:
- The acceptance length compared across methods is *tokens per target step*: a request that
  produced n tokens of which a accepted draft tokens took n - a verification steps (every step
  yields exactly one token of the target's own, plus the drafts it accepted), so
  tau = n / (n - a). For a drafter that proposes at every step this is vLLM's
  1 + accepted / drafts up to the first (prefill) step; for n-gram, which proposes only where it
  finds a match, it counts the steps it did not propose in too. That is what decides speed, so it
  is the number every method is ranked by; vLLM's own counter ratio is kept beside it.
- A pool of prompts is one ratio, sum n / sum (n - a), not a mean of per-prompt ratios: long
  answers weigh as many steps as they took.
- The interval is a percentile bootstrap over prompts (prompts are the unit that varies between
  suites; tokens within a prompt are not independent), seeded so a report is reproducible:
  ``BOOTSTRAP_RESAMPLES`` resamples, 95%.
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95


def ratio_interval(
    numerators, denominators, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL
) -> tuple[float, float, float]:
    """(sum num / sum den, low, high): the pooled ratio and its percentile-bootstrap interval over rows."""
    num = np.asarray(numerators, dtype=np.float64)
    den = np.asarray(denominators, dtype=np.float64)
    if num.shape != den.shape or num.ndim != 1 or num.size == 0:
        raise ValueError(f"ratio_interval needs two equal, non-empty 1-D sequences (got {num.shape}, {den.shape})")
    if (den <= 0).any():
        raise ValueError("ratio_interval: every denominator must be positive")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, num.size, size=(resamples, num.size))
    ratios = num[picks].sum(axis=1) / den[picks].sum(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return float(num.sum() / den.sum()), float(low), float(high)


def _steps(row: dict) -> int:
    return row["completion_tokens"] - row["accepted_tokens"]


def pooled(rows: list[dict]) -> dict:
    """Tokens per target step over ``rows`` (per-prompt counts from matrix.per_prompt_row), with its interval."""
    usable = [r for r in rows if r["ok"] and _steps(r) > 0]
    if not usable:
        return {"prompts": 0, "acceptance_length": None, "ci95": None}
    tau, low, high = ratio_interval([r["completion_tokens"] for r in usable], [_steps(r) for r in usable])
    drafts = sum(r["drafts"] for r in usable)
    accepted = sum(r["accepted_tokens"] for r in usable)
    return {
        "prompts": len(usable),
        "acceptance_length": tau,
        "ci95": [low, high],
        "completion_tokens": sum(r["completion_tokens"] for r in usable),
        "accepted_tokens": accepted,
        "drafts": drafts,
        "acceptance_length_vllm": 1.0 + accepted / drafts if drafts else None,
    }


def paired_difference(
    rows: list[dict], base_rows: list[dict], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict:
    """tau(rows) - tau(base_rows) over the prompts both answered, with a paired percentile-bootstrap interval:
    both pools are resampled with the same prompts, so the prompts' own spread cancels out (an ablation arm
    against its baseline on one suite)."""
    base = {r["id"]: r for r in base_rows if r["ok"] and _steps(r) > 0}
    pairs = [(r, base[r["id"]]) for r in rows if r["ok"] and _steps(r) > 0 and r["id"] in base]
    if not pairs:
        return {"prompts": 0, "difference": None, "ci95": None}

    def column(side: int, of) -> np.ndarray:
        return np.array([of(pair[side]) for pair in pairs], dtype=np.float64)

    def tokens(row: dict) -> int:
        return row["completion_tokens"]

    a_n, a_d, b_n, b_d = column(0, tokens), column(0, _steps), column(1, tokens), column(1, _steps)
    picks = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
    diffs = a_n[picks].sum(1) / a_d[picks].sum(1) - b_n[picks].sum(1) / b_d[picks].sum(1)
    tail = (1.0 - LEVEL) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    return {
        "prompts": len(pairs),
        "difference": float(a_n.sum() / a_d.sum() - b_n.sum() / b_d.sum()),
        "ci95": [float(low), float(high)],
    }


def by_category(rows: list[dict], category_of: dict[str, str]) -> dict:
    """{"pooled": pooled(all), "categories": {category: pooled(its rows)}} in the suite's category order."""
    cats: dict[str, list[dict]] = {}
    for row in rows:
        cats.setdefault(category_of.get(row["id"], "uncategorised"), []).append(row)
    return {"pooled": pooled(rows), "categories": {c: pooled(rs) for c, rs in cats.items()}}
