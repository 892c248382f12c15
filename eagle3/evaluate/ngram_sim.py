"""vLLM's n-gram (prompt-lookup) speculator replayed offline over greedy answers.

Why: greedy decoding is lossless under speculation, so the tokens a request produces do not depend
on the speculator; only how many verification steps they take does. Given the target's greedy
answer to a prompt (its prompt token ids and completion ids, from one server without speculation),
the n-gram proposer's drafts and the accepted tokens can be replayed exactly for any
(prompt_lookup_min, prompt_lookup_max, K) without serving the target again. That turns a grid of
n-gram settings from one server start and one pass per cell into seconds of Python, and the replay
is checked against vLLM's live counters for the settings that are served
(benchmarks/bench_free_speculators.py).

The proposer's rule (vllm/v1/spec_decode/ngram_proposer.py, vLLM 0.32, read for this): in the
context so far (prompt + output), find the longest n in [min, max] such that the context's last n
tokens also occur earlier; among the earlier occurrences of that n-gram take the first; propose the
(up to) K tokens that followed it. No match of at least min tokens: no proposal that step. The
verification accepts the longest prefix of the draft that equals the greedy continuation, then the
target's own next token is appended.

The step after the last output token is not replayed: drafts past ``max_tokens`` are unknown here
(vLLM may count a few accepted tokens the length cap then drops; the check against live counters
measures that).
"""

from __future__ import annotations


class _Index:
    """n-grams of a growing token list, n in 1..max_n, each mapped to the start of its first occurrence,
    indexed only up to the token before the last (the suffix itself must not match itself)."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.first: list[dict[tuple, int]] = [dict() for _ in range(max_n + 1)]
        self.ends = 0  # n-grams ending before position ``ends`` are indexed

    def catch_up(self, tokens: list[int]) -> None:
        while self.ends < len(tokens) - 1:
            end = self.ends + 1  # exclusive end of the n-grams added now
            for n in range(1, min(self.max_n, end) + 1):
                self.first[n].setdefault(tuple(tokens[end - n : end]), end - n)
            self.ends = end

    def propose(self, tokens: list[int], min_n: int, k: int) -> list[int]:
        self.catch_up(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            start = self.first[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                begin = start + n
                return tokens[begin : begin + k]
        return []


def replay(prompt_ids: list[int], output_ids: list[int], *, min_n: int, max_n: int, k: int) -> dict:
    """Drafts, draft tokens and accepted tokens of one greedy request under the n-gram speculator."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"n-gram replay needs 1 <= min_n <= max_n and k >= 1 (got {min_n}, {max_n}, {k})")
    tokens = list(prompt_ids) + list(output_ids[:1])  # the first output token comes from the prefill step
    index = _Index(max_n)
    done, drafts, draft_tokens, accepted = min(1, len(output_ids)), 0, 0, 0
    while done < len(output_ids):
        draft = index.propose(tokens, min_n, k)
        hit = 0
        while hit < len(draft) and done + hit < len(output_ids) and draft[hit] == output_ids[done + hit]:
            hit += 1
        if draft:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(draft), accepted + hit
        step = min(hit + 1, len(output_ids) - done)
        tokens += output_ids[done : done + step]
        done += step
    return {
        "completion_tokens": len(output_ids),
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
    }
