"""The target's tokenizer as every stage sees it: where it is, how it loads, how many ids it has.

Prepare (the self-prompt source), tokenize, vocab, extract and train all read the same tokenizer
and size token ids the same way; they resolve it here rather than asking the tokenize stage.
transformers is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.durable import read_json
from eagle3.errors import InputError
from eagle3.models import resolve_model


def tokenizer_path(config: PipelineConfig) -> str:
    return resolve_model(config.tokenize.tokenizer or config.server.model)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def vocab_size(tokenizer, *folders: str) -> int:
    """The target's vocabulary: the largest of the tokenizer's length and the ``vocab_size``
    (embedding rows) of each folder's config.json. Configs often pad the embedding past the
    tokenizer (Qwen3: 151,936 rows for 151,669 tokens); ids, counts and ``t2d`` follow the rows."""
    declared = [declared_vocab_size(Path(folder)) for folder in folders]
    return max(len(tokenizer), *declared)


def declared_vocab_size(folder: Path) -> int:
    """``vocab_size`` of a folder's config.json (its ``text_config`` for multimodal models); 0 without one."""
    path = folder / "config.json"
    if not path.exists():
        return 0
    config = read_json(path)
    value = (config.get("text_config") or config).get("vocab_size", config.get("vocab_size"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise InputError(f"{path}: vocab_size={value!r} is not a non-negative integer")
    return int(value or 0)


def target_vocab_size(config: PipelineConfig, tokenizer, tok_path: str) -> int:
    """The vocabulary size every stage sizes token ids by: the target model's config counts even
    when ``tokenize.tokenizer`` names a separate tokenizer folder."""
    folders = [tok_path] if not config.tokenize.tokenizer else [tok_path, resolve_model(config.server.model)]
    return vocab_size(tokenizer, *folders)
