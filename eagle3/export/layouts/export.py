"""Export one training checkpoint in several layouts: check it fits the target, refuse what a layout cannot
hold before writing anything, then write each layout's folder."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3.export.layouts.base import UnsupportedLayout
from eagle3.export.layouts.files import (
    EXPORT_VERSION,
    ExportError,
    load_checkpoint,
    read_target_config,
    source_fingerprint,
    target_embedding,
    text_config,
)
from eagle3.export.layouts.registry import layout_for, unsupported_reasons


def check_fits_target(c, target_config: dict) -> list[str]:
    """Problems between a drafter config and the target it will serve."""
    t = text_config(target_config)
    problems = []
    for ours, theirs in (
        ("hidden_size", "hidden_size"),
        ("target_hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
    ):
        if getattr(c, ours) != t.get(theirs):
            problems.append(f"drafter {ours}={getattr(c, ours)} but the target's {theirs} is {t.get(theirs)}")
    layers = int(t.get("num_hidden_layers", 0))
    if (
        len(c.aux_layer_ids) != 3
        or len(set(c.aux_layer_ids)) != 3
        or not all(1 <= i <= layers for i in c.aux_layer_ids)
    ):
        problems.append(f"aux layer ids {c.aux_layer_ids}: need three distinct ids in 1..{layers} (vLLM numbering)")
    if not 1 <= c.draft_vocab_size <= c.vocab_size:
        problems.append(f"draft_vocab_size {c.draft_vocab_size} not in 1..{c.vocab_size}")
    return problems


def export_checkpoint(
    ckpt_dir: str | Path, target_path: str | Path, out_root: str | Path, formats, *, num_speculative_tokens: int = 3
) -> dict[str, Path]:
    """Write ``out_root/<layout>`` for each of ``formats``; {layout: folder}.

    Raises ExportError when the checkpoint does not fit the target, UnsupportedLayout when a
    requested layout cannot hold this drafter (nothing is written then)."""
    ckpt_dir, out_root = Path(ckpt_dir), Path(out_root)
    formats = list(dict.fromkeys(formats))
    c, state = load_checkpoint(ckpt_dir)
    target_config = read_target_config(target_path)
    problems = check_fits_target(c, target_config)
    if problems:
        raise ExportError(f"checkpoint {ckpt_dir} does not fit target {target_path}: " + "; ".join(problems))
    layers = int(text_config(target_config)["num_hidden_layers"])
    for name in formats:
        reasons = unsupported_reasons(name, c, layers)
        if reasons:
            raise UnsupportedLayout(name, reasons)
    layouts = [layout_for(name) for name in formats]
    info = {
        "export_version": EXPORT_VERSION,
        "source_checkpoint": str(ckpt_dir.resolve()),
        "source_sha256": source_fingerprint(ckpt_dir),
        "target": str(target_path),
        "aux_layer_ids_vllm_numbering": list(c.aux_layer_ids),
        "draft_vocab_size": c.draft_vocab_size,
        "num_speculative_tokens": int(num_speculative_tokens),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    embed = target_embedding(target_path) if any(layout.stores_embedding for layout in layouts) else None
    return {
        layout.name: layout.write(
            out_root / layout.name, c, state, target_path, target_config, info, num_speculative_tokens, embed
        )
        for layout in layouts
    }
