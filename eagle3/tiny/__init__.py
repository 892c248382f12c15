"""A tiny Qwen3/Llama model and tokenizer, built offline and deterministically.

Tests and the demo cannot reach the Hugging Face hub, so the project makes its
own target: a byte-level BPE tokenizer trained on generated text, chat
templates with generation markers, and random weights shaped to sample like a
reasoning model (think, ``</think>``, answer, end-of-turn). Importing this
package is cheap; torch/transformers/tokenizers load only when building.
"""

from eagle3.tiny.build import BUILD_VERSION, build_tiny, ensure_tiny
from eagle3.tiny.specs import ARCHS

__all__ = ["ARCHS", "BUILD_VERSION", "build_tiny", "ensure_tiny"]
