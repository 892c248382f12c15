"""What every layout shares: file names, errors, tensor shapes, and the ``Layout`` class a layout fills in.

A layout is one subclass of ``Layout``: its ``name`` (the value in ``export.formats``), which drafters
it cannot express (``unsupported_reasons``), what its ``config.json`` holds (``build_config``), which
tensors it stores and under which names (``layer_prefix``, ``stores_embedding``, ``expected_tensors``),
and how its config is read back (``config_view``, ``config_problems``, ``written_aux_ids``,
``tensor_problems``). Writing (``write``) and the checks every layout gets (``validate``) live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3.durable import read_json
from eagle3.export.layouts.files import (
    CONFIG,
    EMBED,
    WEIGHTS,
    ExportError,
    read_target_config,
    text_config,
    write_layout,
)

# Keys the one-layer Llama/Qwen3 config must hold, wherever a layout nests it.
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


class UnsupportedLayout(ExportError):
    """The drafter cannot be expressed in the requested layout; ``reasons`` says why."""

    def __init__(self, layout: str, reasons: list[str]):
        self.layout, self.reasons = layout, reasons
        super().__init__(f"{layout} layout cannot hold this drafter: " + "; ".join(reasons))


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
    norm_before_fc: bool = False  # EAGLE-3.1's input_norm over the concatenated aux states

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
            bool(getattr(c, "norm_before_fc", False)),
        )


def layer_config(c) -> dict[str, Any]:
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


def eagle_config(cfg: dict) -> dict:
    """The ``eagle_config`` object of a written config ({} when absent or not an object)."""
    return cfg["eagle_config"] if isinstance(cfg.get("eagle_config"), dict) else {}


def missing_keys(cfg: dict, keys) -> list[str]:
    return [f"config.json lacks {k}" for k in keys if k not in cfg]


def _torch_dtype(kind: str):
    import torch

    return {"float": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}[kind]


class Layout:
    """One checkpoint layout. Subclasses set the class attributes and fill in the marked hooks."""

    name: ClassVar[str]
    # Where the drafter layer's weights live: this project's names (EAGLE) or speculators' layers.0.
    layer_prefix: ClassVar[str] = "midlayer."
    # Whether the layout stores the target's embedding table (then it is required, and checked against the target).
    stores_embedding: ClassVar[bool] = False
    # What export_info.json says about embed_tokens.
    embedding_note: ClassVar[str] = "not stored: the serving engine shares the target's"

    # -- what it supports ----------------------------------------------------------------------

    def unsupported_reasons(self, drafter, num_target_layers: int) -> list[str]:
        """Why this layout cannot hold ``drafter`` for a target of ``num_target_layers`` layers ([] = it can)."""
        return []

    def require_support(self, drafter, num_target_layers: int) -> None:
        """Raise UnsupportedLayout, with every reason, when this layout cannot hold ``drafter``."""
        reasons = self.unsupported_reasons(drafter, num_target_layers)
        if reasons:
            raise UnsupportedLayout(self.name, reasons)

    # -- writing -------------------------------------------------------------------------------

    def build_config(self, c, target_path: str, target_config: dict, num_speculative_tokens: int = 3) -> dict:
        """The config.json of this layout for drafter config ``c``."""
        raise NotImplementedError

    def expected_tensors(self, s: Shapes) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, kind), kind one of "float" | "int64" | "bool". embed_tokens is listed (and so
        required) only when the layout stores it."""
        p = self.layer_prefix
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
        if s.norm_before_fc:
            out["input_norm.weight"] = ((s.num_aux * s.target_hidden,), "float")
        if s.arch == "qwen3":
            out[f"{p}self_attn.q_norm.weight"] = ((s.head_dim,), "float")
            out[f"{p}self_attn.k_norm.weight"] = ((s.head_dim,), "float")
        # vLLM creates draft_id_to_target_id only for a smaller draft vocabulary; a d2t without it fails the loader.
        if s.draft_vocab != s.vocab:
            out["d2t"] = ((s.draft_vocab,), "int64")
        if self.stores_embedding:
            out[EMBED] = ((s.vocab, H), "float")
        return out

    def export_state(self, c, state: dict, embed=None) -> dict:
        """The tensors this layout stores: bf16 floats, int64 d2t (only for a smaller draft vocab), bool t2d,
        and, when the layout stores it, ``embed`` (the target's embedding table) as embed_tokens."""
        want = self.expected_tensors(Shapes.of(c))
        out, problems = {}, []
        if EMBED in want and embed is not None:
            state = {**state, EMBED: embed}
        for name, tensor in state.items():
            if (name == EMBED and EMBED not in want) or (name == "d2t" and "d2t" not in want):
                continue
            key = self.layer_prefix + name[len("midlayer.") :] if name.startswith("midlayer.") else name
            if key not in want:
                problems.append(f"unexpected tensor {name} in the checkpoint")
                continue
            shape, kind = want[key]
            if tuple(tensor.shape) != shape:
                problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
                continue
            out[key] = tensor.detach().to("cpu", _torch_dtype(kind)).contiguous()
        problems += [f"checkpoint lacks {k}" for k in want if k not in out]
        if problems:
            raise ExportError(f"{self.name}: checkpoint does not match its drafter config: " + "; ".join(problems))
        return out

    def write(
        self, out_dir: Path, c, state: dict, target_path, target_config: dict, info: dict, num_tokens: int, embed=None
    ) -> Path:
        """Write this layout's folder ``out_dir`` (config, weights, export_info.json) aside and rename it in."""
        config = self.build_config(c, str(target_path), target_config, num_tokens)
        marker = {**info, "layout": self.name, "embed_tokens": self.embedding_note}
        return write_layout(out_dir, config, self.export_state(c, state, embed), marker)

    # -- reading back ----------------------------------------------------------------------------

    def config_view(self, cfg: dict) -> tuple[dict, list[str]]:
        """(the dict holding the layer keys, problems with this layout's own config keys)."""
        raise NotImplementedError

    def config_problems(self, cfg: dict, layer: dict, arch: str) -> list[str]:
        """Problems with the layout's architecture and flags, once the keys are known to be there."""
        if not isinstance(cfg.get("norm_before_residual"), bool):
            return [f"norm_before_residual must be written as a bool, got {cfg.get('norm_before_residual')!r}"]
        return []

    def written_norms(self, cfg: dict) -> tuple[bool, list[str]]:
        """(norm_before_fc as written, problems): EAGLE-3.1's flags must be bools where written."""
        problems = [
            f"{k} must be a bool, got {cfg[k]!r}"
            for k in ("norm_before_fc", "norm_output")
            if k in cfg and not isinstance(cfg[k], bool)
        ]
        return cfg.get("norm_before_fc") is True, problems

    def written_aux_ids(self, cfg: dict, num_layers: int) -> tuple[Any, str, tuple[int, int], list[str]]:
        """(the aux ids as written, where, their valid range in this layout's numbering, problems found on the way)."""
        return cfg.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids", (1, num_layers), []

    def to_vllm_ids(self, ids: list[int]) -> list[int]:
        """Aux ids in this layout's numbering -> vLLM's (the drafter's own)."""
        return list(ids)

    def tensor_problems(self, tensors: dict, target_path) -> list[str]:
        """Checks of the loaded tensors (those of the right shape and dtype) beyond the vocabulary maps."""
        return []

    def aux_ids(self, cfg: dict, num_layers: int) -> tuple[list[int] | None, list[str]]:
        """The aux ids in vLLM numbering, with problems about how they are written."""
        raw, where, (lo, hi), problems = self.written_aux_ids(cfg, num_layers)
        if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            return None, problems + [f"{where} missing or not a list of ints: {raw!r}"]
        if len(raw) != 3 or len(set(raw)) != 3:
            problems.append(f"{where}={raw}: need three distinct ids")
        bad = [i for i in raw if not lo <= i <= hi]
        if bad:
            problems.append(f"{where}={raw}: {bad} outside {lo}..{hi} for a {num_layers}-layer target")
        return self.to_vllm_ids(raw), problems

    def validate(self, folder: str | Path, target_path: str | Path) -> list[str]:
        """Load an export back and check it against the target; [] when it is sound."""
        from eagle3.export.layouts.checks import check_tensors, target_numbers

        folder = Path(folder)
        for name in (CONFIG, WEIGHTS):
            if not (folder / name).exists():
                return [f"{folder / name} missing"]
        try:
            cfg = read_json(folder / CONFIG)
            target = text_config(read_target_config(target_path))
        except (ValueError, OSError) as exc:
            return [str(exc)]
        H, V, L = target_numbers(target)
        layer, problems = self.config_view(cfg)
        problems += [f"layer config lacks {k}" for k in LAYER_KEYS if k not in layer]
        if problems:
            return problems
        arch = "qwen3" if layer["model_type"] == "qwen3" else "llama"
        problems += self._layer_problems(cfg, layer, arch, H, V)
        D = cfg["draft_vocab_size"]
        if not isinstance(D, int) or not 1 <= D <= V:
            return problems + [f"draft_vocab_size={D!r} not an int in 1..{V}"]
        ids, id_problems = self.aux_ids(cfg, L)
        norm_before_fc, norm_problems = self.written_norms(cfg)
        problems += id_problems + norm_problems
        try:
            numbers = (int(layer[k]) for k in _SHAPE_KEYS)
            shapes = Shapes(arch, *numbers, V, D, H, len(ids) if ids else 3, norm_before_fc)
        except (TypeError, ValueError) as exc:
            return problems + [f"layer config values are not integers: {exc}"]
        tensor_issues, tensors = check_tensors(folder / WEIGHTS, self.expected_tensors(shapes), shapes, D, V)
        return problems + tensor_issues + self.tensor_problems(tensors, target_path)

    def _layer_problems(self, cfg: dict, layer: dict, arch: str, H: int, V: int) -> list[str]:
        problems = []
        if layer["model_type"] not in ("llama", "qwen3"):
            problems.append(f"model_type {layer['model_type']!r} is neither llama nor qwen3")
        problems += self.config_problems(cfg, layer, arch)
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
        return problems


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
