"""The ``vllm`` layout: the EAGLE layout (what yuhuili/EAGLE3-* and SpecForge publish).

Weights keep this project's names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``). The
config is a flat Llama/Qwen3 config of the one drafter layer plus the EAGLE-3 keys. Facts from vLLM's
sources (vllm/model_executor/models/{llama,qwen3}_eagle3.py, v1/worker/gpu_model_runner.py): the target
runner reads the aux layer ids top-level (``eagle_aux_hidden_state_layer_ids``), the drafter reads
``eagle_config`` (``use_aux_hidden_state``, the ids for the fc width): both are written.
``norm_before_residual`` defaults to False here and to True in the speculators layout, so it is always
written. ``d2t`` is written only when the draft vocabulary is smaller than the target's: vLLM creates its
``draft_id_to_target_id`` parameter only then, and a ``d2t`` tensor without that parameter fails the weight
loader. ``t2d`` is always written (vLLM and SGLang skip it).

The frozen embedding table is left out: vLLM shares the target's when a drafter has none
(v1/spec_decode/llm_base_proposer.py), and training keeps an exact copy of the target's, so writing it
would only add vocab x H bytes. Any drafter this project trains fits this layout.
"""

from __future__ import annotations

from eagle3.export.layouts.base import Layout, eagle_config, layer_config, missing_keys

ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
EAGLE_KEYS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "torch_dtype",
)


def use_aux_problems(cfg: dict) -> list[str]:
    """vLLM's and SGLang's drafters read the fc input width from eagle_config.use_aux_hidden_state."""
    return (
        []
        if eagle_config(cfg).get("use_aux_hidden_state") is True
        else ["eagle_config.use_aux_hidden_state is not true"]
    )


class VllmLayout(Layout):
    name = "vllm"

    def build_config(self, c, target_path: str, target_config: dict, num_speculative_tokens: int = 3) -> dict:
        ids = [int(i) for i in c.aux_layer_ids]
        return {
            "architectures": [ARCHITECTURES["qwen3" if c.arch == "qwen3" else "llama"]],
            **layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": bool(c.norm_before_residual),
            # EAGLE-3.1's norms: vLLM reads norm_before_fc from eagle_config first, then top-level, and
            # norm_output top-level; both are written where either is read.
            "norm_before_fc": bool(c.norm_before_fc),
            "norm_output": bool(c.norm_output),
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": ids,
                "use_aux_hidden_state": True,
                **(
                    {"norm_before_fc": True} if c.norm_before_fc else {}
                ),  # nested only when on: older exports as before
            },
        }

    def config_view(self, cfg: dict) -> tuple[dict, list[str]]:
        return cfg, missing_keys(cfg, EAGLE_KEYS)

    def config_problems(self, cfg: dict, layer: dict, arch: str) -> list[str]:
        problems = []
        if cfg["architectures"] != [ARCHITECTURES[arch]]:
            problems.append(
                f"architectures {cfg['architectures']} for model_type {arch}: expected [{ARCHITECTURES[arch]!r}]"
            )
        return problems + super().config_problems(cfg, layer, arch)

    def written_norms(self, cfg: dict) -> tuple[bool, list[str]]:
        top, problems = super().written_norms(cfg)
        nested = eagle_config(cfg).get("norm_before_fc", cfg.get("norm_before_fc", False))
        if nested is not top and "norm_before_fc" in eagle_config(cfg):
            problems.append(
                f"eagle_config.norm_before_fc={nested!r} differs from the top-level {top!r} (vLLM reads the nested one)"
            )
        return nested is True, problems

    def written_aux_ids(self, cfg: dict, num_layers: int):
        raw, where, bounds, problems = super().written_aux_ids(cfg, num_layers)
        nested = eagle_config(cfg).get("eagle_aux_hidden_state_layer_ids")
        if nested != raw:
            problems.append(f"eagle_config.eagle_aux_hidden_state_layer_ids={nested} differs from the top-level {raw}")
        return raw, where, bounds, problems + use_aux_problems(cfg)
