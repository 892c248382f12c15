"""Naming the target model: hub ids, local folders, and the tiny offline models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TINY_PREFIX = "tiny:"


def resolve_model(spec: str) -> str:
    """A path or hub id vLLM and transformers can load; ``tiny:ARCH`` is built on demand."""
    if spec.startswith(TINY_PREFIX):
        from eagle3.tiny import ensure_tiny

        return str(ensure_tiny(spec[len(TINY_PREFIX):]))
    return spec


def template_hash(model_path: str) -> str:
    """A hash of the chat template a local model folder ships, so a new template means new
    generations; '' for hub ids (the server's template is whatever that revision has)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return ""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        text = jinja.read_text(encoding="utf-8")
    else:
        config = folder / "tokenizer_config.json"
        text = json.loads(config.read_text()).get("chat_template", "") if config.exists() else ""
    return hashlib.sha256(str(text).encode()).hexdigest()[:16] if text else ""
