"""Checkpoint layouts: ``[export]``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3.config.base import _Strict


class ExportConfig(_Strict):
    """Checkpoint export (stage ``export``)."""

    formats: list[Literal["vllm", "sglang", "speculators"]] = Field(
        default_factory=lambda: ["vllm", "sglang", "speculators"],
        description=(
            "Checkpoint layouts to write: vllm (EAGLE layout, also what SGLang's EAGLE-3 loads with its own config "
            "keys: see sglang), sglang, speculators (vLLM loads it by passing the folder as the model)."
        ),
    )
