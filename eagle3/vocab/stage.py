"""Stage ``vocab`` on a run directory: reduce the shards' counts, choose, save, record."""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3.config import PipelineConfig, section_hash
from eagle3.errors import MissingInputError, run_first
from eagle3.manifest import StageCounts, record_stage
from eagle3.tokenize.stage import load_tokenizer, target_vocab_size, tokenizer_path
from eagle3.vocab.mapping import build, must_keep, save, sum_counts


def run_vocab(config: PipelineConfig, shards: list[str], logger=None) -> dict:
    log = logger or logging.getLogger(__name__)
    run = Path(config.run_dir)
    path = tokenizer_path(config)
    tokenizer = load_tokenizer(path)
    target = target_vocab_size(config, tokenizer, path)
    count_files = [run / "tokenized" / f"{Path(s).stem}.counts.safetensors" for s in shards]
    missing = [str(p) for p in count_files if not p.exists()]
    if missing:
        raise MissingInputError(
            "vocab", run / "tokenized", run_first("eagle3 tokenize"), f"lacks the token counts {missing}"
        )
    counts = sum_counts(count_files, target)
    vocab = build(counts, config.vocab.draft_vocab_size, must_keep(tokenizer))
    out = run / "vocab" / "draft_vocab.safetensors"
    save(vocab, out)
    draft = len(vocab.d2t)
    log.info(
        "vocab: %d of %d ids, coverage %.4f%s -> %s",
        draft,
        target,
        vocab.coverage,
        " (identity)" if vocab.identity else "",
        out,
    )
    rows = int((counts > 0).sum())
    return record_stage(
        run,
        "vocab",
        StageCounts(rows, rows),
        status="ok",
        path=str(out),
        draft_vocab_size=draft,
        target_vocab_size=target,
        coverage=vocab.coverage,
        identity=vocab.identity,
        supervised_tokens=int(counts.sum()),
        config_hash=section_hash(config.vocab),
        counted="distinct supervised token ids",
    )
