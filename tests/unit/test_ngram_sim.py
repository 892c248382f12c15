"""The offline replay of vLLM's n-gram speculator (eagle3/evaluate/ngram_sim.py)."""

from __future__ import annotations

import pytest

from eagle3.evaluate.ngram_sim import _Index, replay


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule read straight: longest n in [min, max] whose suffix occurs earlier; its first occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(0, len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_longest_match_wins_and_ties_take_the_first_occurrence():
    tokens = [7, 1, 2, 9, 5, 1, 2, 3, 8, 1, 2]
    # "1 2" occurs at 1 and 5: the first is taken, so the draft is what followed it there: 9 5 1.
    assert _Index(3).propose(tokens, 2, 3) == [9, 5, 1]
    # "8 1 2" is longer but never occurred before, "2" alone is below min 2 when "1 2" exists anyway.
    assert _Index(3).propose(tokens + [3], 2, 3) == [8, 1, 2]  # "1 2 3" occurred at 5
    assert _Index(3).propose([1, 2, 3, 4], 2, 3) == []  # nothing repeats


def test_a_draft_stops_at_the_end_of_the_context():
    assert _Index(2).propose([4, 5, 4, 5], 2, 3) == [4, 5]


@pytest.mark.parametrize("min_n, max_n, k", [(1, 1, 1), (2, 4, 3), (1, 5, 5), (3, 3, 2)])
def test_the_index_agrees_with_the_rule_read_straight(min_n, max_n, k):
    import random

    rng = random.Random(min_n * 100 + max_n * 10 + k)
    tokens = [rng.randrange(6) for _ in range(200)]
    index = _Index(max_n)
    for end in range(1, len(tokens) + 1):
        assert index.propose(tokens[:end], min_n, k) == _brute_force(tokens[:end], min_n, max_n, k), end


def test_replay_counts_drafts_and_accepted_tokens():
    prompt = [1, 2, 3, 4]
    # after the prefill token 1: context 1 2 3 4 1 -> "1" matched at 0 (min 1), draft 2 3 4; the greedy
    # answer goes 2 3 5: two accepted, then the target's 5; context ... 1 2 3 5 -> no earlier "3 5" or "5",
    # no proposal: one step for 6.
    counts = replay(prompt, [1, 2, 3, 5, 6], min_n=1, max_n=2, k=3)
    assert counts == {"completion_tokens": 5, "drafts": 1, "draft_tokens": 3, "accepted_tokens": 2}
    # tokens per step: 5 tokens in 3 steps (prefill, the verified draft, the last one)
    assert counts["completion_tokens"] - counts["accepted_tokens"] == 3


def test_replay_of_an_answer_that_copies_the_prompt_accepts_nearly_everything():
    prompt = list(range(10, 60))
    counts = replay(prompt, prompt[:40], min_n=2, max_n=4, k=3)
    # the first output token is the prompt's first; from the second step on every draft is right
    assert counts["accepted_tokens"] >= 28 and counts["drafts"] <= 13


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        replay([1], [1], min_n=3, max_n=2, k=1)
