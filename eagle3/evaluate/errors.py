"""Errors of stage ``evaluate`` that more than one of its modules raises (servers.py, live.py)."""

from __future__ import annotations

from eagle3.errors import TransientError


class EvaluationFailed(TransientError, RuntimeError):
    """Requests failed outright, or vLLM never drafted (speculative decoding not engaged)."""
