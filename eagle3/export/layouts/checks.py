"""Checks of an exported weights file that do not depend on the layout: names, shapes, dtypes, vocabulary maps."""

from __future__ import annotations

from pathlib import Path

from eagle3.export.layouts.files import EMBED


def target_numbers(target: dict) -> tuple[int, int, int]:
    """(hidden size, vocabulary size, number of layers) of the target's text config."""
    return int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])


def check_tensors(weights: Path, want: dict, shapes, D: int, V: int) -> tuple[list[str], dict]:
    """(problems, the tensors of the right shape and dtype) of ``weights`` against ``want`` (name -> shape, kind).
    An embed_tokens the layout does not list is allowed, and checked to be [V, hidden]."""
    import torch
    from safetensors import safe_open

    problems = []
    with safe_open(str(weights), framework="pt") as fh:
        names = set(fh.keys())
        for name in sorted(names - set(want) - {EMBED}):
            problems.append(f"unexpected tensor {name}" + (_D2T_NOTE if name == "d2t" else ""))
        for name in [n for n in want if n not in names]:
            problems.append(f"missing tensor {name}")
        dtype_of = {"float": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
        tensors = {}
        for name in sorted(names & (set(want) | {EMBED})):
            shape, kind = want.get(name, ((V, shapes.hidden), "float"))
            tensor = fh.get_tensor(name)
            if tuple(tensor.shape) != shape:
                problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
            elif tensor.dtype != dtype_of[kind]:
                problems.append(f"{name}: dtype {tensor.dtype}, expected {dtype_of[kind]}")
            elif kind == "float" and not torch.isfinite(tensor.float()).all():
                problems.append(f"{name}: holds NaN or inf")
            else:
                tensors[name] = tensor
    return problems + check_vocab_map(tensors.get("d2t"), tensors.get("t2d"), D, V), tensors


_D2T_NOTE = " (vLLM only creates draft_id_to_target_id when the draft vocabulary is smaller than the target's)"


def check_vocab_map(d2t, t2d, D: int, V: int) -> list[str]:
    import torch

    problems = []
    if d2t is not None:
        targets = torch.arange(D, dtype=torch.int64) + d2t
        if targets.min() < 0 or targets.max() >= V:
            problems.append(
                f"d2t maps draft ids to target ids {int(targets.min())}..{int(targets.max())}, outside 0..{V - 1}"
            )
        elif D > 1 and not bool((targets[1:] > targets[:-1]).all()):
            problems.append("d2t: draft ids do not map to strictly increasing (distinct) target ids")
        elif t2d is not None and not bool(t2d[targets].all()):
            problems.append("t2d is not set at the target ids d2t maps to")
    if t2d is not None and int(t2d.sum()) != D:
        problems.append(f"t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {D}")
    return problems
