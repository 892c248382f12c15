"""Write a trained drafter checkpoint in the layouts serving engines load, and check them.

Three layouts, one set of weights (bf16 safetensors, ``model.safetensors`` + ``config.json``):

- ``vllm`` -- the EAGLE layout (what yuhuili/EAGLE3-* and SpecForge publish). Weights keep this
  project's names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). The config is
  a flat Llama/Qwen3 config of the one drafter layer plus the EAGLE-3 keys. Facts from vLLM's
  sources (vllm/model_executor/models/{llama,qwen3}_eagle3.py, v1/worker/gpu_model_runner.py):
  the target runner reads the aux layer ids top-level (``eagle_aux_hidden_state_layer_ids``), the
  drafter reads ``eagle_config`` (``use_aux_hidden_state``, the ids for the fc width): both are
  written. ``norm_before_residual`` defaults to False here and to True in the speculators layout,
  so it is always written. ``d2t`` is written only when the draft vocabulary is smaller than the
  target's: vLLM creates its ``draft_id_to_target_id`` parameter only then, and a ``d2t`` tensor
  without that parameter fails the weight loader. ``t2d`` is always written (vLLM and SGLang skip it).
- ``speculators`` -- vllm-project/speculators' layout: ``speculators_model_type: eagle3``, the
  layer config nested in ``transformer_layer_config``, ``speculators_config`` (proposal method,
  verifier), weights ``layers.0.*`` instead of ``midlayer.*``. vLLM turns it into the same model
  (vllm/transformers_utils/configs/speculators/algos.py ``update_eagle3``). It also holds what
  speculators' own Eagle-3 converter writes (speculators 0.9.0, convert/eagle/eagle3_converter.py
  and models/eagle3/config.py): the top-level fields ``speculators_version``, ``transformers_version``,
  ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` (false: this drafter has none of those norms;
  vLLM reads them too) and ``embed_requires_grad``, and the target's **whole** embedding table
  ``embed_tokens.weight`` [target vocab, H]. speculators builds ``embed_tokens`` over the full
  verifier vocabulary (``DraftVocabMixin._init_vocab``) and fills it from the verifier only when it
  is still NaN after loading, which transformers 5.x's initialisation defeats: without the tensor a
  drafter loaded through ``SpeculatorModel.from_pretrained`` has an all-zero embedding.
- ``sglang`` -- SGLang's ``LlamaForCausalLMEagle3`` (python/sglang/srt/models/llama_eagle3.py):
  the EAGLE layout's weight names, a Llama config with ``num_hidden_layers: 1``, and the aux ids
  read **only** from ``eagle_config.eagle_aux_hidden_state_layer_ids``, in SGLang's numbering:
  SGLang captures ``layers_to_capture = [id + 1 for id in ids]`` at the *input* of decoder layer
  ``id + 1`` (srt/models/llama.py, qwen3.py), i.e. SGLang id ``j`` is the output of layer ``j`` =
  vLLM id ``j + 1``. So the sglang export writes vLLM ids minus one. Its drafter layer has no
  q/k norms and always takes the residual before ``hidden_norm``; a Qwen3-style drafter, a
  ``norm_before_residual`` drafter or a last-layer aux id (vLLM id L, which SGLang never
  captures) cannot be expressed, and asking for one raises ``UnsupportedLayout``.

The vllm and sglang layouts leave the frozen embedding table out: vLLM shares the target's when a
drafter has none (v1/spec_decode/llm_base_proposer.py), SGLang always installs the target's
(``set_embed``), and training keeps an exact copy of the target's, so writing it would only add
vocab x H bytes. The speculators layout writes it (see above), read from the target's own files
(training checkpoints do not hold it); vLLM finds it equal to the target's and shares that one.

Each layout folder is written to a temporary folder next to it and renamed into place.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.durable import (
    install_folder,
    owned_prefix,
    read_json,
    remove_inside,
    remove_orphaned_temporaries,
    sha256_file,
)
from eagle3.errors import InputError

LAYOUTS = ("vllm", "sglang", "speculators")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INFO = "export_info.json"
CKPT_CONFIG = "drafter_config.json"
EXPORT_VERSION = 1
EMBED = "embed_tokens.weight"

ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
)
EAGLE_KEYS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "torch_dtype",
)
SPECULATORS_KEYS = (
    "architectures",
    "speculators_model_type",
    "transformer_layer_config",
    "speculators_config",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "speculators_version",
    "transformers_version",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
)
# The speculators release whose Eagle3SpeculatorConfig this layout follows (its config records the
# library version that wrote it; ours records the format it matches).
SPECULATORS_FORMAT_VERSION = "0.9.0"
# Norm variants speculators (and vLLM) can add to an Eagle-3 drafter; this drafter has none of them.
SPECULATORS_ABSENT_NORMS = ("norm_before_fc", "fc_norm", "norm_output")


class ExportError(InputError, ValueError):
    """The checkpoint cannot be exported (missing files, shapes that do not fit the target)."""


class UnsupportedLayout(ExportError):
    """The drafter cannot be expressed in the requested layout; ``reasons`` says why."""

    def __init__(self, layout: str, reasons: list[str]):
        self.layout, self.reasons = layout, reasons
        super().__init__(f"{layout} layout cannot hold this drafter: " + "; ".join(reasons))


# -- inputs ---------------------------------------------------------------------------------


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


def load_checkpoint(ckpt_dir: str | Path):
    """(DrafterConfig, state dict) of a training checkpoint folder."""
    from safetensors.torch import load_file

    from eagle3.drafter.model import DrafterConfig

    ckpt_dir = Path(ckpt_dir)
    missing = [name for name in (WEIGHTS, CKPT_CONFIG) if not (ckpt_dir / name).exists()]
    if missing:
        raise ExportError(f"checkpoint {ckpt_dir} lacks {missing}: not a drafter checkpoint folder")
    return DrafterConfig.load(ckpt_dir / CKPT_CONFIG), load_file(str(ckpt_dir / WEIGHTS))


# -- what each layout holds -------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    """The numbers every tensor shape follows from."""

    arch: str  # "llama" | "qwen3"
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    num_aux: int

    @classmethod
    def of(cls, c) -> Shapes:
        return cls(
            c.arch,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.vocab_size,
            c.draft_vocab_size,
            c.target_hidden_size,
            len(c.aux_layer_ids),
        )


def layer_prefix(layout: str) -> str:
    return "layers.0." if layout == "speculators" else "midlayer."


def expected_tensors(s: Shapes, layout: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) with kind "float" | "int64" | "bool". embed_tokens is required in the
    speculators layout and optional (not listed) in the others."""
    p = layer_prefix(layout)
    H, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((H, s.num_aux * s.target_hidden), "float"),
        f"{p}input_layernorm.weight": ((H,), "float"),
        f"{p}hidden_norm.weight": ((H,), "float"),
        f"{p}self_attn.q_proj.weight": ((q, 2 * H), "float"),
        f"{p}self_attn.k_proj.weight": ((kv, 2 * H), "float"),
        f"{p}self_attn.v_proj.weight": ((kv, 2 * H), "float"),
        f"{p}self_attn.o_proj.weight": ((H, q), "float"),
        f"{p}post_attention_layernorm.weight": ((H,), "float"),
        f"{p}mlp.gate_proj.weight": ((s.intermediate, H), "float"),
        f"{p}mlp.up_proj.weight": ((s.intermediate, H), "float"),
        f"{p}mlp.down_proj.weight": ((H, s.intermediate), "float"),
        "norm.weight": ((H,), "float"),
        "lm_head.weight": ((s.draft_vocab, H), "float"),
        "t2d": ((s.vocab,), "bool"),
    }
    if s.arch == "qwen3":
        out[f"{p}self_attn.q_norm.weight"] = ((s.head_dim,), "float")
        out[f"{p}self_attn.k_norm.weight"] = ((s.head_dim,), "float")
    if s.draft_vocab != s.vocab:
        out["d2t"] = ((s.draft_vocab,), "int64")
    if layout == "speculators":
        out[EMBED] = ((s.vocab, H), "float")
    return out


def unsupported_reasons(layout: str, drafter_config, num_target_layers: int) -> list[str]:
    """Why ``layout`` cannot hold this drafter ([] = it can)."""
    if layout not in LAYOUTS:
        return [f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})"]
    if layout != "sglang":
        return []
    c, reasons = drafter_config, []
    if c.arch == "qwen3":
        reasons.append(
            "SGLang's EAGLE-3 drafter (LlamaForCausalLMEagle3) is a Llama layer without q_norm/k_norm; "
            "it would drop this Qwen3-style drafter's q/k norms silently"
        )
    if c.norm_before_residual:
        reasons.append("SGLang's drafter always takes the residual before hidden_norm (norm_before_residual=False)")
    out_of_range = [i for i in c.aux_layer_ids if not 1 <= i <= num_target_layers - 1]
    if out_of_range:
        reasons.append(
            f"aux layer ids {out_of_range} (vLLM numbering) have no SGLang equivalent: SGLang captures the "
            f"input of a decoder layer, so only ids 1..{num_target_layers - 1} exist there"
        )
    return reasons


def _layer_config(c) -> dict[str, Any]:
    """The one drafter layer as a Llama/Qwen3 config (keys read by transformers 4.x and 5.x alike)."""
    cfg: dict[str, Any] = {
        "model_type": "qwen3" if c.arch == "qwen3" else "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        # transformers < 5 reads rope_theta; 5.x reads rope_parameters (and folds rope_theta into it).
        # The drafter is trained with plain rotary embeddings at the target's base, so "default".
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        # transformers 5 reads "dtype", 4.x "torch_dtype" (5 still accepts it, with a warning).
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }
    if c.arch != "qwen3":
        cfg["mlp_bias"] = False
    return cfg


def build_config(layout: str, c, target_path: str, target_config: dict, num_speculative_tokens: int = 3) -> dict:
    """The config.json of ``layout`` for drafter config ``c``."""
    ids = [int(i) for i in c.aux_layer_ids]
    if layout == "vllm":
        return {
            "architectures": [ARCHITECTURES["qwen3" if c.arch == "qwen3" else "llama"]],
            **_layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": bool(c.norm_before_residual),
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
    if layout == "sglang":
        sglang_ids = [i - 1 for i in ids]
        return {
            "architectures": [SGLANG_ARCHITECTURE],
            **_layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
        }
    if layout == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": _layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": bool(c.norm_before_residual),
            "eagle_aux_hidden_state_layer_ids": ids,
            **{name: False for name in SPECULATORS_ABSENT_NORMS},
            "embed_requires_grad": False,  # the embedding is the target's, frozen (as training keeps it)
            "speculators_version": SPECULATORS_FORMAT_VERSION,
            "transformers_version": _transformers_version(),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": int(num_speculative_tokens),
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {
                    "name_or_path": str(target_path),
                    "architectures": list(target_config.get("architectures") or []),
                },
            },
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
        }
    raise ExportError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")


def _transformers_version() -> str:
    from importlib import metadata

    return metadata.version("transformers")


def target_embedding(target_path: str | Path):
    """The target's input embedding table [V, H], read from its own files (checkpoints lack it)."""
    from eagle3.train.target import load_target_head

    return load_target_head(str(target_path)).embed


def export_state(layout: str, c, state: dict, embed=None) -> dict:
    """The tensors ``layout`` stores: bf16 floats, int64 d2t (only for a smaller draft vocab), bool t2d,
    and for the speculators layout ``embed`` (the target's embedding table) as embed_tokens."""
    import torch

    prefix = layer_prefix(layout)
    want = expected_tensors(Shapes.of(c), layout)
    out, problems = {}, []
    if EMBED in want and embed is not None:
        state = {**state, EMBED: embed}
    for name, tensor in state.items():
        if (name == EMBED and EMBED not in want) or (name == "d2t" and "d2t" not in want):
            continue
        key = prefix + name[len("midlayer.") :] if name.startswith("midlayer.") else name
        if key not in want:
            problems.append(f"unexpected tensor {name} in the checkpoint")
            continue
        shape, kind = want[key]
        if tuple(tensor.shape) != shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
            continue
        dtype = {"float": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}[kind]
        out[key] = tensor.detach().to("cpu", dtype).contiguous()
    problems += [f"checkpoint lacks {k}" for k in want if k not in out]
    if problems:
        raise ExportError(f"{layout}: checkpoint does not match its drafter config: " + "; ".join(problems))
    return out


# -- writing ----------------------------------------------------------------------------------


def write_layout(out_dir: Path, config: dict, tensors: dict, info: dict) -> Path:
    from safetensors.torch import save_file

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temporaries(out_dir)  # a folder half written, or an old one set aside, by a killed export
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix(out_dir), suffix=".tmp", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        install_folder(tmp, out_dir)
    finally:
        if tmp.exists():
            remove_inside(tmp, out_dir.parent, ignore_errors=True)
    return out_dir


def source_fingerprint(ckpt_dir: str | Path) -> dict[str, str]:
    ckpt_dir = Path(ckpt_dir)
    return {name: sha256_file(ckpt_dir / name) for name in (WEIGHTS, CKPT_CONFIG)}


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
    for layout in formats:
        reasons = unsupported_reasons(layout, c, layers)
        if reasons:
            raise UnsupportedLayout(layout, reasons)
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
    embed = target_embedding(target_path) if "speculators" in formats else None
    written = {}
    for layout in formats:
        config = build_config(layout, c, str(target_path), target_config, num_speculative_tokens)
        held = (
            "the target's embedding table, copied (speculators' loader does not fill it)"
            if layout == "speculators"
            else "not stored: the serving engine shares the target's"
        )
        written[layout] = write_layout(
            out_root / layout,
            config,
            export_state(layout, c, state, embed),
            {**info, "layout": layout, "embed_tokens": held},
        )
    return written


# -- validation -------------------------------------------------------------------------------


def _layer_view(layout: str, cfg: dict) -> tuple[dict, list[str]]:
    """(the dict holding the layer keys, config problems specific to the layout)."""
    problems = []
    if layout == "speculators":
        missing = [k for k in SPECULATORS_KEYS if k not in cfg]
        problems += [f"config.json lacks {k}" for k in missing]
        if cfg.get("speculators_model_type") != "eagle3":
            problems.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, not 'eagle3'")
        spec = cfg.get("speculators_config") or {}
        try:
            tokens = spec["proposal_methods"][0]["speculative_tokens"]
            if not isinstance(tokens, int) or tokens < 1:
                problems.append(
                    f"speculators_config.proposal_methods[0].speculative_tokens={tokens!r} is not an int >= 1"
                )
        except (KeyError, IndexError, TypeError):
            problems.append("speculators_config.proposal_methods[0].speculative_tokens missing")
        if not (spec.get("verifier") or {}).get("name_or_path"):
            problems.append("speculators_config.verifier.name_or_path missing")
        problems += _speculators_field_problems(cfg)
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            return {}, problems + ["transformer_layer_config is not an object"]
        return layer, problems
    keys = (
        EAGLE_KEYS if layout == "vllm" else ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")
    )
    problems += [f"config.json lacks {k}" for k in keys if k not in cfg]
    return cfg, problems


def _speculators_field_problems(cfg: dict) -> list[str]:
    """The top-level fields speculators' Eagle3SpeculatorConfig reads, with the values this drafter needs."""
    problems = []
    for name in SPECULATORS_ABSENT_NORMS:
        if name in cfg and cfg[name] is not False:
            problems.append(
                f"{name}={cfg[name]!r}: this drafter has no such norm (speculators and vLLM would add an "
                "untrained one); must be false"
            )
    if "embed_requires_grad" in cfg and not isinstance(cfg["embed_requires_grad"], bool):
        problems.append(f"embed_requires_grad must be a bool, got {cfg['embed_requires_grad']!r}")
    for name in ("speculators_version", "transformers_version"):
        if name in cfg and not (isinstance(cfg[name], str) and cfg[name]):
            problems.append(f"{name} must be a version string, got {cfg[name]!r}")
    return problems


def _aux_ids(layout: str, cfg: dict, num_layers: int) -> tuple[list[int] | None, list[str]]:
    """The aux ids in vLLM numbering, with problems about how they are written."""
    problems = []
    eagle = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if layout == "sglang":
        raw = eagle.get("eagle_aux_hidden_state_layer_ids")
        lo, hi = 0, num_layers - 2
        where = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang numbering)"
    else:
        raw = cfg.get("eagle_aux_hidden_state_layer_ids")
        lo, hi = 1, num_layers
        where = "eagle_aux_hidden_state_layer_ids"
        if layout == "vllm":
            if eagle.get("eagle_aux_hidden_state_layer_ids") != raw:
                problems.append(
                    f"eagle_config.eagle_aux_hidden_state_layer_ids={eagle.get('eagle_aux_hidden_state_layer_ids')} "
                    f"differs from the top-level {raw}"
                )
    if layout in ("vllm", "sglang") and eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state is not true")
    if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        return None, problems + [f"{where} missing or not a list of ints: {raw!r}"]
    if len(raw) != 3 or len(set(raw)) != 3:
        problems.append(f"{where}={raw}: need three distinct ids")
    bad = [i for i in raw if not lo <= i <= hi]
    if bad:
        problems.append(f"{where}={raw}: {bad} outside {lo}..{hi} for a {num_layers}-layer target")
    return ([i + 1 for i in raw] if layout == "sglang" else list(raw)), problems


def validate_export(folder: str | Path, layout: str, target_path: str | Path) -> list[str]:
    """Load an export back and check it against the target; [] when it is sound."""
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    if layout not in LAYOUTS:
        return [f"unknown layout {layout!r}"]
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).exists():
            return [f"{folder / name} missing"]
    try:
        cfg = read_json(folder / CONFIG)
        target = text_config(read_target_config(target_path))
    except (ValueError, OSError) as exc:
        return [str(exc)]
    H, V, L = int(target["hidden_size"]), int(target["vocab_size"]), int(target["num_hidden_layers"])
    layer, problems = _layer_view(layout, cfg)
    problems += [f"layer config lacks {k}" for k in LAYER_KEYS if k not in layer]
    if problems:
        return problems

    arch = "qwen3" if layer["model_type"] == "qwen3" else "llama"
    if layer["model_type"] not in ("llama", "qwen3"):
        problems.append(f"model_type {layer['model_type']!r} is neither llama nor qwen3")
    if layout == "vllm" and cfg["architectures"] != [ARCHITECTURES[arch]]:
        problems.append(
            f"architectures {cfg['architectures']} for model_type {arch}: expected [{ARCHITECTURES[arch]!r}]"
        )
    if layout == "sglang":
        if cfg["architectures"] != [SGLANG_ARCHITECTURE] or arch != "llama":
            problems.append(
                f"SGLang loads a llama-type {SGLANG_ARCHITECTURE}, got {cfg['architectures']} / {layer['model_type']}"
            )
        if cfg.get("norm_before_residual"):
            problems.append(
                "SGLang ignores norm_before_residual=true (it always takes the residual before hidden_norm)"
            )
    if layout != "sglang" and not isinstance(cfg.get("norm_before_residual"), bool):
        problems.append(f"norm_before_residual must be written as a bool, got {cfg.get('norm_before_residual')!r}")
    if layer["num_hidden_layers"] != 1:
        problems.append(f"num_hidden_layers={layer['num_hidden_layers']}: the drafter has one layer")
    if layer["tie_word_embeddings"] is not False:
        problems.append("tie_word_embeddings must be false (the drafter's lm_head is its own)")
    if layer["hidden_size"] != H:
        problems.append(
            f"hidden_size={layer['hidden_size']} but the target's is {H} (the target's embeddings are shared)"
        )
    if cfg["target_hidden_size"] != H:
        problems.append(f"target_hidden_size={cfg['target_hidden_size']} but the target's hidden_size is {H}")
    if layer["vocab_size"] != V:
        problems.append(f"vocab_size={layer['vocab_size']} but the target's is {V}")
    D = cfg["draft_vocab_size"]
    if not isinstance(D, int) or not 1 <= D <= V:
        problems.append(f"draft_vocab_size={D!r} not an int in 1..{V}")
        return problems
    ids, id_problems = _aux_ids(layout, cfg, L)
    problems += id_problems
    try:
        shapes = Shapes(
            arch,
            int(layer["hidden_size"]),
            int(layer["intermediate_size"]),
            int(layer["num_attention_heads"]),
            int(layer["num_key_value_heads"]),
            int(layer["head_dim"]),
            V,
            D,
            H,
            len(ids) if ids else 3,
        )
    except (TypeError, ValueError) as exc:
        return problems + [f"layer config values are not integers: {exc}"]
    want = expected_tensors(shapes, layout)

    with safe_open(str(folder / WEIGHTS), framework="pt") as fh:
        names = set(fh.keys())
        for name in sorted(names - set(want) - {EMBED}):
            problems.append(
                f"unexpected tensor {name}"
                + (
                    " (vLLM only creates draft_id_to_target_id when the draft vocabulary is smaller than the target's)"
                    if name == "d2t"
                    else ""
                )
            )
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
    problems += _check_vocab_map(tensors.get("d2t"), tensors.get("t2d"), D, V)
    if layout == "speculators" and EMBED in tensors:
        problems += _check_embedding(tensors[EMBED], target_path)
    return problems


def _check_embedding(embed, target_path) -> list[str]:
    """The speculators layout's embed_tokens must be the target's table (bf16), not some other one."""
    import torch

    try:
        expected = target_embedding(target_path).to(torch.bfloat16)
    except (ValueError, OSError) as exc:
        return [f"cannot read the target's embedding to check {EMBED}: {exc}"]
    if expected.shape != embed.shape:
        return [f"{EMBED}: shape {tuple(embed.shape)}, the target's embedding is {tuple(expected.shape)}"]
    differ = int((embed != expected).any(dim=1).sum())
    return [f"{EMBED}: {differ} rows differ from the target's embedding"] if differ else []


def _check_vocab_map(d2t, t2d, D: int, V: int) -> list[str]:
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


# -- an untrained checkpoint (for smoke tests of export and serving) --------------------------


def write_untrained_checkpoint(
    target_path: str | Path,
    ckpt_dir: str | Path,
    *,
    draft_ids=None,
    aux_layer_ids: list[int] | None = None,
    seed: int = 0,
) -> Path:
    """A checkpoint folder as training writes one, holding an untrained drafter.

    Embeddings and the lm_head rows of the draft vocabulary come from the target (as training
    initialises them); the rest is random. ``draft_ids``: sorted target ids of the draft
    vocabulary (None: the identity, all of them)."""
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
    from eagle3.extract.hf import default_layer_ids
    from eagle3.train.target import load_target_head

    layers = aux_layer_ids or default_layer_ids(int(t["num_hidden_layers"]))
    head_parts = load_target_head(str(target))
    embed, head = head_parts.embed, head_parts.lm_head
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(tcfg, int(ids.numel()), list(layers))
    model = Eagle3Drafter(config)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.init_from_target(embed.float(), head.float(), ids - torch.arange(ids.numel()), t2d)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(ckpt_dir / WEIGHTS) as tmp:
        save_file({k: v.contiguous() for k, v in model.trainable_state().items()}, str(tmp))
    atomic_write_bytes(ckpt_dir / CKPT_CONFIG, config.to_json().encode())
    return ckpt_dir
