"""How benchmarks/table.py writes numbers and Markdown tables (shared by its section modules)."""

from __future__ import annotations


def num(value, digits: int | None = None) -> str:
    """Integers grouped by thousands; floats with ``digits`` decimals, or by default 3 below 100 and
    none above (a ratio needs its decimals, a rate does not)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if digits is None:
        digits = 3 if abs(value) < 100 else 0
    return f"{value:,.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(num(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def interval(ci) -> str:
    """A [low, high] interval with two decimals, or - when there is none."""
    return f"[{num(ci[0], 2)}, {num(ci[1], 2)}]" if ci else "-"
