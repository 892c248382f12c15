"""Write a trained drafter checkpoint in the layouts serving engines load, and check them.

Three layouts, one set of weights (bf16 safetensors, ``model.safetensors`` + ``config.json``), each a
class in its own module with the loader facts it follows: ``vllm`` (the EAGLE layout, vllm.py),
``sglang`` (SGLang's Llama EAGLE-3 drafter, sglang.py) and ``speculators`` (vllm-project/speculators'
format, speculators.py). ``base.Layout`` is what a layout fills in; ``registry`` maps the names in
``export.formats`` to the classes; ``export_checkpoint`` writes, ``validate_export`` reads back and checks.
"""

from eagle3.export.layouts.base import LAYER_KEYS, Layout, Shapes, UnsupportedLayout
from eagle3.export.layouts.export import check_fits_target, export_checkpoint
from eagle3.export.layouts.files import (
    CKPT_CONFIG,
    CONFIG,
    EMBED,
    EXPORT_VERSION,
    INFO,
    WEIGHTS,
    ExportError,
    load_checkpoint,
    read_target_config,
    source_fingerprint,
    target_embedding,
    text_config,
    write_layout,
)
from eagle3.export.layouts.registry import LAYOUT_CLASSES, LAYOUTS, layout_for, unsupported_reasons, validate_export
from eagle3.export.layouts.untrained import write_untrained_checkpoint

__all__ = [
    "CKPT_CONFIG",
    "CONFIG",
    "EMBED",
    "EXPORT_VERSION",
    "INFO",
    "LAYER_KEYS",
    "LAYOUTS",
    "LAYOUT_CLASSES",
    "WEIGHTS",
    "ExportError",
    "Layout",
    "Shapes",
    "UnsupportedLayout",
    "check_fits_target",
    "export_checkpoint",
    "layout_for",
    "load_checkpoint",
    "read_target_config",
    "source_fingerprint",
    "target_embedding",
    "text_config",
    "unsupported_reasons",
    "validate_export",
    "write_layout",
    "write_untrained_checkpoint",
]
