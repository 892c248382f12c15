"""The ``speculators`` layout: vllm-project/speculators' Eagle-3 format.

``speculators_model_type: eagle3``, the layer config nested in ``transformer_layer_config``,
``speculators_config`` (proposal method, verifier), weights ``layers.0.*`` instead of ``midlayer.*``. vLLM
turns it into the same model (vllm/transformers_utils/configs/speculators/algos.py ``update_eagle3``). It
also holds what speculators' own Eagle-3 converter writes (speculators 0.9.0,
convert/eagle/eagle3_converter.py and models/eagle3/config.py): the top-level fields
``speculators_version``, ``transformers_version``, ``norm_before_fc`` / ``fc_norm`` / ``norm_output``
(the first and last as trained, train.norm_before_fc / norm_output; fc_norm always false; vLLM reads
them too) and ``embed_requires_grad``, and the
target's **whole** embedding table ``embed_tokens.weight`` [target vocab, H]. speculators builds
``embed_tokens`` over the full verifier vocabulary (``DraftVocabMixin._init_vocab``) and fills it from the
verifier only when it is still NaN after loading, which transformers 5.x's initialisation defeats: without
the tensor a drafter loaded through ``SpeculatorModel.from_pretrained`` has an all-zero embedding. The
table is read from the target's own files (training checkpoints do not hold it); vLLM finds it equal to the
target's and shares that one.
"""

from __future__ import annotations

from eagle3.export.layouts.base import Layout, layer_config, missing_keys
from eagle3.export.layouts.files import EMBED, target_embedding

KEYS = (
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
FORMAT_VERSION = "0.9.0"
# Norm variants speculators (and vLLM) can add to an Eagle-3 drafter: norm_before_fc and norm_output are
# this drafter's train knobs (EAGLE-3.1), fc_norm (one norm per aux state) it never has.
ABSENT_NORMS = ("fc_norm",)


def _transformers_version() -> str:
    from importlib import metadata

    return metadata.version("transformers")


class SpeculatorsLayout(Layout):
    name = "speculators"
    layer_prefix = "layers.0."
    stores_embedding = True
    embedding_note = "the target's embedding table, copied (speculators' loader does not fill it)"

    def build_config(self, c, target_path: str, target_config: dict, num_speculative_tokens: int = 3) -> dict:
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": bool(c.norm_before_residual),
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in c.aux_layer_ids],
            "norm_before_fc": bool(c.norm_before_fc),
            "fc_norm": False,
            "norm_output": bool(c.norm_output),
            "embed_requires_grad": False,  # the embedding is the target's, frozen (as training keeps it)
            "speculators_version": FORMAT_VERSION,
            "transformers_version": _transformers_version(),
            "speculators_config": _speculators_config(target_path, target_config, num_speculative_tokens),
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
        }

    def config_view(self, cfg: dict) -> tuple[dict, list[str]]:
        problems = missing_keys(cfg, KEYS)
        if cfg.get("speculators_model_type") != "eagle3":
            problems.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, not 'eagle3'")
        problems += _proposal_problems(cfg.get("speculators_config") or {}) + _field_problems(cfg)
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            return {}, problems + ["transformer_layer_config is not an object"]
        return layer, problems

    def tensor_problems(self, tensors: dict, target_path) -> list[str]:
        return _check_embedding(tensors[EMBED], target_path) if EMBED in tensors else []


def _speculators_config(target_path: str, target_config: dict, num_speculative_tokens: int) -> dict:
    return {
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
    }


def _proposal_problems(spec: dict) -> list[str]:
    problems = []
    try:
        tokens = spec["proposal_methods"][0]["speculative_tokens"]
        if not isinstance(tokens, int) or tokens < 1:
            problems.append(f"speculators_config.proposal_methods[0].speculative_tokens={tokens!r} is not an int >= 1")
    except (KeyError, IndexError, TypeError):
        problems.append("speculators_config.proposal_methods[0].speculative_tokens missing")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path missing")
    return problems


def _field_problems(cfg: dict) -> list[str]:
    """The top-level fields speculators' Eagle3SpeculatorConfig reads, with the values this drafter needs."""
    problems = []
    for name in ABSENT_NORMS:
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


def _check_embedding(embed, target_path) -> list[str]:
    """embed_tokens must be the target's table (bf16), not some other one."""
    import torch

    try:
        expected = target_embedding(target_path).to(torch.bfloat16)
    except (ValueError, OSError) as exc:
        return [f"cannot read the target's embedding to check {EMBED}: {exc}"]
    if expected.shape != embed.shape:
        return [f"{EMBED}: shape {tuple(embed.shape)}, the target's embedding is {tuple(expected.shape)}"]
    differ = int((embed != expected).any(dim=1).sum())
    return [f"{EMBED}: {differ} rows differ from the target's embedding"] if differ else []
