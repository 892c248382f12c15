"""The target's tokenizer as every stage sees it: where it is, how it loads, what identifies it,
how many ids it has.

Prepare (the self-prompt source), tokenize, vocab, extract and train all read the same tokenizer
and size token ids the same way. The run's facts (eagle3/run_facts.py) resolve its path and hash
once with these helpers and hand them to each stage; no stage asks the tokenize stage.
transformers is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.durable import read_json, sha256_file
from eagle3.errors import InputError
from eagle3.models import resolve_model


def tokenizer_path(config: PipelineConfig) -> str:
    return resolve_model(config.tokenize.tokenizer or config.server.model)


def tokenizer_fingerprint(path: str) -> str:
    """What the tokenize stage keys its shards on: the tokenizer's files, its chat template and the
    model's config.json (any of them changed, the shards are rebuilt); the path itself for a hub id."""
    folder = Path(path)
    digest = hashlib.sha256(path.encode() if not folder.is_dir() else b"")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (folder / name).exists():
            digest.update(name.encode() + sha256_file(folder / name).encode())
    return digest.hexdigest()[:16]


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


def target_vocab_size(tokenizer, tok_path: str, model_path: str | None = None) -> int:
    """The vocabulary size every stage sizes token ids by: the target model's config counts even
    when ``tokenize.tokenizer`` names a separate tokenizer folder (``model_path``, the target's)."""
    return vocab_size(tokenizer, *dict.fromkeys(p for p in (tok_path, model_path) if p))
