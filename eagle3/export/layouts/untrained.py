"""An untrained drafter checkpoint, written as training writes one (for smoke tests of export and serving)."""

from __future__ import annotations

from pathlib import Path

from eagle3.export.layouts.files import CKPT_CONFIG, WEIGHTS, read_target_config, text_config


def write_untrained_checkpoint(
    target_path: str | Path,
    ckpt_dir: str | Path,
    *,
    draft_ids=None,
    aux_layer_ids: list[int] | None = None,
    seed: int = 0,
    norm_before_fc: bool = False,
    norm_output: bool = False,
) -> Path:
    """A checkpoint folder as training writes one, holding an untrained drafter.

    Embeddings and the lm_head rows of the draft vocabulary come from the target (as training
    initialises them); the rest is random. ``draft_ids``: sorted target ids of the draft
    vocabulary (None: the identity, all of them). ``norm_before_fc`` / ``norm_output``: EAGLE-3.1's norms
    (train.norm_before_fc / norm_output)."""
    import torch
    from safetensors.torch import save_file

    from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3.durable import atomic_path, atomic_write_bytes

    target, ckpt_dir = Path(target_path), Path(ckpt_dir)
    tcfg = read_target_config(target)
    t = text_config(tcfg)
    V = int(t["vocab_size"])
    ids = (
        torch.arange(V, dtype=torch.int64) if draft_ids is None else torch.as_tensor(list(draft_ids), dtype=torch.int64)
    )
    if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"draft_ids must be strictly increasing target ids in 0..{V - 1}")
    from eagle3.models import default_layer_ids
    from eagle3.train.target import load_target_head

    layers = aux_layer_ids or default_layer_ids(int(t["num_hidden_layers"]))
    head_parts = load_target_head(str(target))
    embed, head = head_parts.embed, head_parts.lm_head
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(
        tcfg, int(ids.numel()), list(layers), norm_before_fc=norm_before_fc, norm_output=norm_output
    )
    model = Eagle3Drafter(config)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.init_from_target(embed.float(), head.float(), ids - torch.arange(ids.numel()), t2d)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(ckpt_dir / WEIGHTS) as tmp:
        save_file({k: v.contiguous() for k, v in model.trainable_state().items()}, str(tmp))
    atomic_write_bytes(ckpt_dir / CKPT_CONFIG, config.to_json().encode())
    return ckpt_dir
