"""The live comparison as a person reads it: table rows, a markdown table, one summary line."""

from __future__ import annotations

COLUMNS = (
    "prompt set",
    "T",
    "concurrency",
    "method",
    "decode tok/s",
    "speed-up vs none",
    "speed-up vs n-gram",
    "acceptance length",
    "per-position acceptance",
    "rounds (decode tok/s spread)",
    "greedy identical",
    "requests ok",
)


def _f(value, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _spread(cell: dict) -> str:
    s = cell["decode_tokens_per_s_spread"]
    if s["min"] is None:
        return f"{len(cell['rounds'])}"
    return f"{len(cell['rounds'])} ({_f(s['min'], 1)}-{_f(s['max'], 1)}, ±{_f(100 * (s['relative'] or 0) / 2, 0)}%)"


def _acceptance(cell: dict) -> str:
    value = _f(cell["mean_acceptance_length"])
    if cell["method"].startswith("none"):
        return "1 (by definition)"
    return value + (
        " (steps with a proposal only)" if cell["method"].startswith("ngram") and cell["mean_acceptance_length"] else ""
    )


def cell_row(cell: dict) -> dict:
    """One table row (strings) per cell: the Prefect artifact and the markdown table share it."""
    greedy = f"{cell['greedy_identical']}/{cell['greedy_compared']}" if "greedy_compared" in cell else "-"
    return {
        "prompt set": cell["prompt_set"],
        "T": f"{cell['temperature']:g}",
        "concurrency": str(cell["concurrency"]),
        "method": cell["method"],
        "decode tok/s": _f(cell["decode_tokens_per_s"], 1),
        "speed-up vs none": _f(cell.get("speedup_vs_none"), 2, "x"),
        "speed-up vs n-gram": _f(cell.get("speedup_vs_ngram"), 2, "x"),
        "acceptance length": _acceptance(cell),
        "per-position acceptance": ", ".join(_f(x) for x in cell["per_position_acceptance"]) or "-",
        "rounds (decode tok/s spread)": _spread(cell),
        "greedy identical": greedy,
        "requests ok": f"{cell['requests_ok']}/{cell['requests']}",
    }


def markdown_table(doc: dict) -> str:
    """The whole comparison with the prompt-set labels and the definitions under it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell_row(c)[k] for k in COLUMNS) + " |" for c in doc["cells"]]
    lines += ["", "Prompt sets:"]
    for name, info in doc["prompt_sets"].items():
        note = info["selection"].get("note")
        lines.append(
            f"- **{name}** ({len(info['prompt_ids'])} prompts): {info['label']}" + (f". Note: {note}" if note else "")
        )
    lines += [
        "",
        f"K = {doc['num_speculative_tokens']} speculative tokens, {doc['max_tokens']} max tokens per request, "
        f"{doc['rounds']} round(s), servers {doc['servers']}. Decode tok/s: {doc['decode_rate_definition']}",
        "",
        "Acceptance length = 1 + accepted / drafts from vLLM's counters. n-gram's counters count only the steps "
        "where it proposed tokens, so compare speed-ups, not its acceptance length. Greedy identical: answers at "
        "T=0 equal to the reference method's (none when measured; none_compiled for a *_compiled method), "
        "over all rounds.",
    ]
    head = doc.get("headline") or {}
    if head.get("speedup_fastest_vs_fastest_none") is not None:
        lines += [
            "",
            (
                "*_compiled: the same server without --enforce-eager. Headline cell: the faster trained server "
                f"({head['fastest_trained_method']}) decodes {_f(head['speedup_fastest_vs_fastest_none'], 2, 'x')} "
                f"as fast as the faster no-speculation server ({head['fastest_none_method']}) and "
                f"{_f(head.get('speedup_fastest_vs_fastest_ngram'), 2, 'x')} as fast as the faster n-gram server "
                f"({head.get('fastest_ngram_method') or 'n/a'})."
            ),
        ]
    return "\n".join(lines)


def summary_line(head: dict | None) -> str | None:
    """One line for the CLI: the headline cell, or None when there is none."""
    if not head:
        return None
    rates = head.get("decode_tokens_per_s") or {}
    where = f"{head['prompt_set']} prompts, T={head['temperature']:g}, concurrency {head['concurrency']}"
    parts = [f"{m} {_f(r, 1)} tok/s" for m, r in rates.items()]
    accept = [
        f"{m} {_f(head.get(f'acceptance_length_{m}'))}"
        for m in ("trained", "untrained", "ngram")
        if head.get(f"acceptance_length_{m}") is not None
    ]
    speed = [
        f"{_f(head.get(k), 2, 'x')} vs {k.rsplit('_', 1)[1]}"
        for k in ("speedup_vs_none", "speedup_vs_ngram")
        if head.get(k) is not None
    ]
    fastest = head.get("speedup_fastest_vs_fastest_none")
    if fastest is not None:
        speed.append(
            f"fastest trained ({head['fastest_trained_method']}) {_f(fastest, 2, 'x')} vs fastest none "
            f"({head['fastest_none_method']})"
        )
    return (
        f"live ({where}): decode {', '.join(parts)}"
        + (f"; acceptance length {', '.join(accept)}" if accept else "")
        + (f"; trained {', '.join(speed)}" if speed else "")
    )
