"""Acceptance per prompt and its bootstrap interval (eagle3/evaluate/intervals.py)."""

from __future__ import annotations

import math

import pytest

from eagle3.evaluate import intervals


def _binomial_quantile(n: int, q: float) -> int:
    """Smallest k with P(Binomial(n, 1/2) <= k) >= q."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) / 2**n
        if total >= q:
            return k
    return n


def test_bootstrap_bounds_match_the_exact_resampling_distribution():
    # 40 prompts, half at tau 1 and half at tau 3, one step each: a resample's pooled ratio is
    # 1 + 2k/40 with k ~ Binomial(40, 1/2), so its 2.5% / 97.5% quantiles are known exactly.
    n = 40
    nums = [1.0] * 20 + [3.0] * 20
    dens = [1.0] * n
    tau, low, high = intervals.ratio_interval(nums, dens, seed=7)
    assert tau == pytest.approx(2.0)
    expected_low = 1 + 2 * _binomial_quantile(n, 0.025) / n
    expected_high = 1 + 2 * _binomial_quantile(n, 0.975) / n
    step = 2 / n  # one prompt more or less of either kind
    assert abs(low - expected_low) <= step and abs(high - expected_high) <= step
    assert low < tau < high


def test_bootstrap_is_seeded_and_a_constant_input_has_no_width():
    nums, dens = [5, 9, 2, 7, 3], [2, 4, 1, 3, 2]
    assert intervals.ratio_interval(nums, dens, seed=3) == intervals.ratio_interval(nums, dens, seed=3)
    assert intervals.ratio_interval(nums, dens, seed=3) != intervals.ratio_interval(nums, dens, seed=4)
    tau, low, high = intervals.ratio_interval([4, 8, 2], [2, 4, 1])
    assert tau == low == high == pytest.approx(2.0)


def test_the_pool_is_a_ratio_of_sums_not_a_mean_of_ratios():
    # a short answer at tau 4 and a long one at tau 1: 100 + 4 tokens over 100 + 1 steps.
    tau, _, _ = intervals.ratio_interval([4, 100], [1, 100])
    assert tau == pytest.approx(104 / 101)


@pytest.mark.parametrize(
    "nums, dens, why",
    [([], [], "non-empty"), ([1, 2], [1], "equal"), ([1, 2], [1, 0], "positive")],
)
def test_bad_input_is_refused(nums, dens, why):
    with pytest.raises(ValueError, match=why):
        intervals.ratio_interval(nums, dens)


def _row(pid, tokens, accepted, drafts, ok=True):
    return {"id": pid, "ok": ok, "completion_tokens": tokens, "accepted_tokens": accepted, "drafts": drafts}


def test_tokens_per_step_counts_the_steps_without_a_proposal():
    # n-gram proposed in 10 of 60 steps and had 20 tokens accepted: 80 tokens took 60 steps,
    # while vLLM's own ratio (1 + accepted / drafts) counts only the 10 proposal steps.
    table = intervals.pooled([_row("a", 80, 20, 10)])
    assert table["acceptance_length"] == pytest.approx(80 / 60)
    assert table["acceptance_length_vllm"] == pytest.approx(3.0)


def test_failed_requests_are_left_out_and_categories_keep_their_order():
    rows = [_row("m1", 30, 10, 10), _row("c1", 30, 20, 10), _row("c2", 0, 0, 0, ok=False), _row("m2", 30, 0, 10)]
    table = intervals.by_category(rows, {"m1": "math", "m2": "math", "c1": "code", "c2": "code"})
    assert list(table["categories"]) == ["math", "code"]
    assert table["pooled"]["prompts"] == 3
    assert table["pooled"]["acceptance_length"] == pytest.approx(90 / 60)
    assert table["categories"]["code"]["acceptance_length"] == pytest.approx(3.0)
    assert table["categories"]["math"]["acceptance_length"] == pytest.approx(60 / 50)
    assert intervals.pooled([_row("x", 0, 0, 0, ok=False)])["acceptance_length"] is None


def test_the_ablations_paired_difference_cancels_the_prompts_own_spread():
    from eagle3.evaluate.intervals import paired_difference

    # prompts of very different difficulty; the arm accepts exactly one more token on each than the baseline
    base = [_row(f"p{i}", 40, a, 39 - a) for i, a in enumerate((0, 5, 10, 20, 30, 35) * 5)]
    arm = [_row(r["id"], 40, r["accepted_tokens"] + 1, r["drafts"]) for r in base]
    same = paired_difference(base, base)
    assert same["difference"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["prompts"] == 30
    better = paired_difference(arm, base)
    assert better["difference"] > 0 and better["ci95"][0] > 0, "a uniform gain is significant when paired"
    # unpaired, the two pools' intervals overlap: the spread between prompts hides the gain
    _, base_low, base_high = intervals.ratio_interval([40] * 30, [40 - r["accepted_tokens"] for r in base])
    _, arm_low, _ = intervals.ratio_interval([40] * 30, [40 - r["accepted_tokens"] for r in arm])
    assert arm_low < base_high
    assert paired_difference(arm, [])["difference"] is None
