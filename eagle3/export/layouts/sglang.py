"""The ``sglang`` layout: SGLang's ``LlamaForCausalLMEagle3`` (python/sglang/srt/models/llama_eagle3.py).

The EAGLE layout's weight names, a Llama config with ``num_hidden_layers: 1``, and the aux ids read
**only** from ``eagle_config.eagle_aux_hidden_state_layer_ids``, in SGLang's numbering: SGLang captures
``layers_to_capture = [id + 1 for id in ids]`` at the *input* of decoder layer ``id + 1``
(srt/models/llama.py, qwen3.py), i.e. SGLang id ``j`` is the output of layer ``j`` = vLLM id ``j + 1``.
So this layout writes vLLM ids minus one. Its drafter layer has no q/k norms and always takes the
residual before ``hidden_norm``; a Qwen3-style drafter, a ``norm_before_residual`` drafter or a last-layer
aux id (vLLM id L, which SGLang never captures) cannot be expressed, and asking for one raises
``UnsupportedLayout``.

The frozen embedding table is left out: SGLang always installs the target's (``set_embed``).
"""

from __future__ import annotations

from eagle3.export.layouts.base import Layout, eagle_config, layer_config, missing_keys
from eagle3.export.layouts.vllm import use_aux_problems

ARCHITECTURE = "LlamaForCausalLMEagle3"
KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")


class SglangLayout(Layout):
    name = "sglang"

    def unsupported_reasons(self, drafter, num_target_layers: int) -> list[str]:
        c, reasons = drafter, []
        if c.arch == "qwen3":
            reasons.append(
                f"SGLang's EAGLE-3 drafter ({ARCHITECTURE}) is a Llama layer without q_norm/k_norm; "
                "it would drop this Qwen3-style drafter's q/k norms silently"
            )
        if c.norm_before_residual:
            reasons.append("SGLang's drafter always takes the residual before hidden_norm (norm_before_residual=False)")
        for flag in ("norm_before_fc", "norm_output"):
            if getattr(c, flag, False):
                reasons.append(f"SGLang's EAGLE-3 drafter has no {flag} (EAGLE-3.1); it would ignore the trained norm")
        out_of_range = [i for i in c.aux_layer_ids if not 1 <= i <= num_target_layers - 1]
        if out_of_range:
            reasons.append(
                f"aux layer ids {out_of_range} (vLLM numbering) have no SGLang equivalent: SGLang captures the "
                f"input of a decoder layer, so only ids 1..{num_target_layers - 1} exist there"
            )
        return reasons

    def build_config(self, c, target_path: str, target_config: dict, num_speculative_tokens: int = 3) -> dict:
        sglang_ids = [int(i) - 1 for i in c.aux_layer_ids]
        return {
            "architectures": [ARCHITECTURE],
            **layer_config(c),
            "draft_vocab_size": c.draft_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "norm_before_residual": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
        }

    def config_view(self, cfg: dict) -> tuple[dict, list[str]]:
        return cfg, missing_keys(cfg, KEYS)

    def config_problems(self, cfg: dict, layer: dict, arch: str) -> list[str]:
        problems = []
        if cfg["architectures"] != [ARCHITECTURE] or arch != "llama":
            problems.append(
                f"SGLang loads a llama-type {ARCHITECTURE}, got {cfg['architectures']} / {layer['model_type']}"
            )
        if cfg.get("norm_before_residual"):
            problems.append(
                "SGLang ignores norm_before_residual=true (it always takes the residual before hidden_norm)"
            )
        return problems

    def written_aux_ids(self, cfg: dict, num_layers: int):
        raw = eagle_config(cfg).get("eagle_aux_hidden_state_layer_ids")
        where = "eagle_config.eagle_aux_hidden_state_layer_ids (SGLang numbering)"
        return raw, where, (0, num_layers - 2), use_aux_problems(cfg)

    def to_vllm_ids(self, ids: list[int]) -> list[int]:
        return [i + 1 for i in ids]
