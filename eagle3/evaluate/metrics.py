"""vLLM's spec-decode counters, read from ``/metrics`` and differenced per measurement window.

Design choices:
- The numbers are vLLM's own counters (``vllm:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="k"}``), summed over label sets (engines)
  and read before and after a window; the difference is that window's. Mean acceptance
  length = 1 + accepted / drafts (each verification step also yields the target's own token).
- Deltas of several windows (rounds) add up to the counters of their union, so a cell's
  acceptance is computed from summed raw counters, not averaged from per-round ratios.
"""

from __future__ import annotations

import re

import httpx

from eagle3.errors import TransientError

COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
METRICS_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


class MetricsUnavailable(TransientError, RuntimeError):
    """/metrics did not answer 200."""


# -- parsing --------------------------------------------------------------------------------


def parse_spec_metrics(text: str) -> dict:
    """The spec-decode counters of a Prometheus text page, summed over label sets (engines).

    {"drafts", "draft_tokens", "accepted_tokens": float, "accepted_per_pos": [float per position],
    "found": whether any spec-decode counter was present}."""
    out = {name: 0.0 for name in COUNTERS.values()}
    per_pos: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, raw = match.groups()
        if name not in COUNTERS and name != PER_POSITION:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        found = True
        if name in COUNTERS:
            out[COUNTERS[name]] += value
        else:
            pos = _POSITION.search(labels or "")
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    out["accepted_per_pos"] = [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)] if per_pos else []
    out["found"] = found
    return out


def raw_delta(before: dict, after: dict) -> dict:
    """The raw counter increments of one window (parse_spec_metrics before and after it)."""
    n = max(len(before["accepted_per_pos"]), len(after["accepted_per_pos"]))
    pad = lambda xs: list(xs) + [0.0] * (n - len(xs))  # noqa: E731
    per = [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]
    out = {k: int(after[k] - before[k]) for k in COUNTERS.values()}
    return {**out, "accepted_per_position": [int(x) for x in per]}


def add_raw(a: dict, b: dict) -> dict:
    """Counters of two windows together (the union of two measurement windows)."""
    n = max(len(a["accepted_per_position"]), len(b["accepted_per_position"]))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    per = [x + y for x, y in zip(pad(a["accepted_per_position"]), pad(b["accepted_per_position"]))]
    return {**{k: a[k] + b[k] for k in COUNTERS.values()}, "accepted_per_position": per}


def with_rates(raw: dict) -> dict:
    """Raw counters plus acceptance rate, mean acceptance length and per-position acceptance."""
    drafts, draft_tokens, accepted = raw["drafts"], raw["draft_tokens"], raw["accepted_tokens"]
    per = raw["accepted_per_position"]
    return {
        **raw,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [x / drafts for x in per] if drafts else [None] * len(per),
    }


def metrics_delta(before: dict, after: dict) -> dict:
    """Counters of one measurement window, with the rates derived from them."""
    return with_rates(raw_delta(before, after))


def fetch_metrics(client: httpx.Client, root_url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = client.get(f"{root_url}/metrics", headers=headers, timeout=METRICS_TIMEOUT)
    if response.status_code != 200:
        raise MetricsUnavailable(f"{root_url}/metrics returned {response.status_code}: {response.text[:200]}")
    return parse_spec_metrics(response.text)
