"""The files an export reads and writes: the target's config and embedding, a training checkpoint, a layout folder.

Each layout folder is written to a temporary folder next to it, every file in it through ``eagle3.durable``,
and the folder is renamed into place: a reader sees the old folder or the new one, never a partial one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from eagle3.durable import (
    atomic_path,
    atomic_write_json,
    install_folder,
    owned_prefix,
    read_json,
    remove_inside,
    remove_orphaned_temporaries,
    sha256_file,
)
from eagle3.errors import InputError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INFO = "export_info.json"
CKPT_CONFIG = "drafter_config.json"
EXPORT_VERSION = 1
EMBED = "embed_tokens.weight"


class ExportError(InputError, ValueError):
    """The checkpoint cannot be exported (missing files, shapes that do not fit the target)."""


def read_target_config(target_path: str | Path) -> dict:
    """The target's config.json as a dict (a local folder, else a hub id through transformers)."""
    folder = Path(target_path)
    if folder.is_dir():
        path = folder / CONFIG
        if not path.exists():
            raise ExportError(f"target {folder} has no {CONFIG}")
        return read_json(path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target_path)).to_dict()


def text_config(target_config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config."""
    return target_config.get("text_config") or target_config


def target_embedding(target_path: str | Path):
    """The target's input embedding table [V, H], read from its own files (checkpoints lack it)."""
    from eagle3.train.target import load_target_head

    return load_target_head(str(target_path)).embed


def load_checkpoint(ckpt_dir: str | Path):
    """(DrafterConfig, state dict) of a training checkpoint folder."""
    from safetensors.torch import load_file

    from eagle3.drafter.model import DrafterConfig

    ckpt_dir = Path(ckpt_dir)
    missing = [name for name in (WEIGHTS, CKPT_CONFIG) if not (ckpt_dir / name).exists()]
    if missing:
        raise ExportError(f"checkpoint {ckpt_dir} lacks {missing}: not a drafter checkpoint folder")
    return DrafterConfig.load(ckpt_dir / CKPT_CONFIG), load_file(str(ckpt_dir / WEIGHTS))


def source_fingerprint(ckpt_dir: str | Path) -> dict[str, str]:
    ckpt_dir = Path(ckpt_dir)
    return {name: sha256_file(ckpt_dir / name) for name in (WEIGHTS, CKPT_CONFIG)}


def write_layout(out_dir: Path, config: dict, tensors: dict, info: dict) -> Path:
    """``out_dir`` holding config.json, model.safetensors and export_info.json, installed whole."""
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temporaries(out_dir)  # a folder half written, or an old one set aside, by a killed export
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix(out_dir), suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        atomic_write_json(tmp / CONFIG, config)
        with atomic_path(tmp / WEIGHTS) as path:
            save_file(tensors, str(path), metadata={"format": "pt"})
        atomic_write_json(tmp / INFO, info)
        install_folder(tmp, out_dir)
    finally:
        if tmp.exists():
            remove_inside(tmp, out_dir.parent, ignore_errors=True)
    return out_dir
