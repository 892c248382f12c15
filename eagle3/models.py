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
    if not Path(model_path).is_dir():
        return ""
    text = chat_template_text(model_path)
    return hashlib.sha256(str(text).encode()).hexdigest()[:16] if text else ""


def chat_template_text(model_path: str) -> str:
    """The chat template a local model folder ships ('' when none is found)."""
    folder = Path(model_path)
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    return str(json.loads(config.read_text()).get("chat_template", "") or "") if config.exists() else ""


def reasoning_parser(setting: str | None, model_path: str) -> str | None:
    """The --reasoning-parser for this target: ``auto`` asks its chat template (a <think> block
    means a Qwen3-style thinking model); a name passes through; '' or None means none."""
    if not setting:
        return None
    if setting != "auto":
        return setting
    return "qwen3" if "<think>" in chat_template_text(model_path) else None


def vllm_launcher(server) -> list[str]:
    """The command that starts vLLM's OpenAI server: ``server.command``, else ``server.python -m ...``
    (default: this interpreter, where the ``gpu`` extra installs vllm)."""
    import sys

    return list(server.command) if server.command else [server.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_args(server, model_path: str) -> list[str]:
    """``server.args`` plus the model-dependent flags the config leaves to the model itself."""
    args = list(server.args)
    if not any(a == "--reasoning-parser" or a.startswith("--reasoning-parser=") for a in args):
        parser = reasoning_parser(server.reasoning_parser, model_path)
        if parser:
            args += ["--reasoning-parser", parser]
    return args
