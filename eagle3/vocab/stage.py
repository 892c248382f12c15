"""Stage ``vocab`` on a run directory: reduce the shards' counts, choose, save, record.

Recomputed on every run (a sum and a sort); ``vocab/done.json`` (eagle3/markers.py) is written
last, keyed on the count files, the target vocabulary size and the ``[vocab]`` settings.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import sha256_file
from eagle3.errors import MissingInputError, run_first
from eagle3.manifest import record_stage
from eagle3.markers import remove_marker, write_marker
from eagle3.results import StageCounts
from eagle3.run_facts import RunFacts
from eagle3.tokenizer import load_tokenizer, target_vocab_size
from eagle3.vocab.mapping import build, must_keep, save, sum_counts

STAGE = "vocab"


def _key(config: PipelineConfig, count_files: list[Path], target: int) -> str:
    parts = [*(sha256_file(p) for p in count_files), str(target), section_hash(config.vocab)]
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:16]


def run_vocab(facts: RunFacts, shards: list[str], logger=None) -> dict:
    """The draft vocabulary from ``shards``' supervised-token counts (the tokenizer and the target's
    size come from the run's facts)."""
    log = logger or logging.getLogger(__name__)
    config, layout = facts.config, facts.layout
    path, _ = facts.tokenizer()
    tokenizer = load_tokenizer(path)
    target = target_vocab_size(tokenizer, path, facts.model_dir())
    count_files = [layout.tokenized_files(s)["counts"] for s in shards]
    missing = [str(p) for p in count_files if not p.exists()]
    if missing:
        raise MissingInputError(
            "vocab", layout.tokenized, run_first("eagle3 tokenize"), f"lacks the token counts {missing}"
        )
    remove_marker(layout.vocab_marker, layout.root)
    counts = sum_counts(count_files, target)
    vocab = build(counts, config.vocab.draft_vocab_size, must_keep(tokenizer))
    out = layout.draft_vocab
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
    results = {
        "path": str(out),
        "draft_vocab_size": draft,
        "target_vocab_size": target,
        "coverage": vocab.coverage,
        "identity": vocab.identity,
        "supervised_tokens": int(counts.sum()),
    }
    entry = record_stage(
        layout.root,
        STAGE,
        StageCounts(rows, rows),
        status="ok",
        **results,
        config_hash=section_hash(config.vocab),
        counted="distinct supervised token ids",
    )
    write_marker(
        layout.vocab_marker,
        STAGE,
        _key(config, count_files, target),
        {"in": rows, "ok": rows},
        **results,
        vocab_sha256=sha256_file(out),
    )
    return entry


def summary_line(entry: dict, run_dir) -> str:
    """The CLI's end-of-run line for this stage."""
    size, coverage = entry["draft_vocab_size"], 100 * entry["coverage"]
    return f"draft vocab:  {entry['path']}  ({size} ids, coverage {coverage:.2f}%)"
