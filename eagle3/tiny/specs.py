"""What differs between the two tiny architectures, in one table.

Everything arch-specific (special tokens, which token ends a turn, which one
pads, the chat template file, the HF config class, rope base) lives in an
``ArchSpec`` so the tokenizer, weight and build code stay arch-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

THINK_START = "<think>"
THINK_END = "</think>"

# Shape of the tiny target. head_dim 32 because vLLM's CPU attention only
# supports a fixed set of head sizes; 4 layers so aux layer ids (low, mid,
# high) are distinct; untied so lm_head rows are independent of embeddings.
HIDDEN_SIZE = 128
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 4096
VOCAB_TARGET = 4096
VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class ArchSpec:
    name: str
    architecture: str
    model_type: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    template_file: str
    rope_theta: float
    # Tokens whose presence earlier in the context switches the model from
    # "reasoning" to "answer" mode (see weights.py).
    answer_triggers: tuple[str, ...]

    @property
    def template_path(self) -> Path:
        return HERE / self.template_file


QWEN3 = ArchSpec(
    name="qwen3",
    architecture="Qwen3ForCausalLM",
    model_type="qwen3",
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    template_file="qwen3_chat_template.jinja",
    rope_theta=1_000_000.0,
    answer_triggers=(THINK_END,),
)

# A Llama-3 prompt never contains </think>; the end of the assistant header
# starts the answer directly, so a llama build behaves like a plain chat model.
LLAMA = ArchSpec(
    name="llama",
    architecture="LlamaForCausalLM",
    model_type="llama",
    specials=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad="<|end_of_text|>",
    template_file="llama3_chat_template.jinja",
    rope_theta=500_000.0,
    answer_triggers=(THINK_END, "<|end_header_id|>"),
)

ARCHS: dict[str, ArchSpec] = {spec.name: spec for spec in (QWEN3, LLAMA)}


def get_spec(arch: str) -> ArchSpec:
    try:
        return ARCHS[arch]
    except KeyError:
        allowed = ", ".join(sorted(ARCHS))
        raise ValueError(f"unknown arch {arch!r}; allowed values: {allowed}") from None
