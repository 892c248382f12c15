"""The layout registry and what each layout class supports (no files but for the cross-validation case)."""

from __future__ import annotations

import typing
from dataclasses import replace

import pytest

from eagle3.config import ExportConfig
from eagle3.drafter.model import DrafterConfig
from eagle3.export.layouts import (
    LAYOUT_CLASSES,
    LAYOUTS,
    ExportError,
    Layout,
    UnsupportedLayout,
    export_checkpoint,
    layout_for,
    unsupported_reasons,
    validate_export,
    write_untrained_checkpoint,
)
from eagle3.tiny import ensure_tiny

LAYERS = 4


def _config_layout_names() -> set[str]:
    (literal,) = typing.get_args(ExportConfig.model_fields["formats"].annotation)
    return set(typing.get_args(literal))


def _drafter(**change) -> DrafterConfig:
    base = DrafterConfig(
        arch="llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=4096,
        draft_vocab_size=1024,
        target_hidden_size=128,
        aux_layer_ids=[1, 2, 3],
    )
    return replace(base, **change)


# What each variant of a trainable drafter is, and the words a refusal of it must carry.
VARIANTS = {
    "qwen3": (_drafter(arch="qwen3"), "q_norm/k_norm"),
    "norm_before_residual": (_drafter(norm_before_residual=True), "norm_before_residual"),
    "last_layer_aux": (_drafter(aux_layer_ids=[1, 2, LAYERS]), f"aux layer ids [{LAYERS}]"),
}
# Which layout refuses which variant; every other pair must be held.
REFUSED = {("sglang", "qwen3"), ("sglang", "norm_before_residual"), ("sglang", "last_layer_aux")}


def test_the_registry_covers_every_layout_name_the_config_accepts():
    names = _config_layout_names()
    assert set(LAYOUTS) == names == set(LAYOUT_CLASSES)
    assert set(ExportConfig().formats) <= names
    for name, cls in LAYOUT_CLASSES.items():
        layout = layout_for(name)
        assert issubclass(cls, Layout) and isinstance(layout, cls) and layout.name == name


def test_an_unknown_layout_name_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ExportError, match="unknown layout 'onnx' \\(known: vllm, sglang, speculators\\)"):
        layout_for("onnx")
    assert unsupported_reasons("onnx", _drafter(), LAYERS) == [
        "unknown layout 'onnx' (known: vllm, sglang, speculators)"
    ]
    assert validate_export(tmp_path, "onnx", tmp_path) == ["unknown layout 'onnx'"]


def test_every_layout_holds_a_plain_llama_drafter():
    for name in LAYOUTS:
        assert layout_for(name).unsupported_reasons(_drafter(), LAYERS) == [], name
        layout_for(name).require_support(_drafter(), LAYERS)


@pytest.mark.parametrize("name", sorted(LAYOUT_CLASSES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_layout_refuses_what_it_cannot_hold_with_its_reason(name, variant):
    drafter, words = VARIANTS[variant]
    layout = layout_for(name)
    reasons = layout.unsupported_reasons(drafter, LAYERS)
    assert unsupported_reasons(name, drafter, LAYERS) == reasons
    if (name, variant) not in REFUSED:
        assert reasons == []
        return
    assert len(reasons) == 1 and words in reasons[0], reasons
    with pytest.raises(UnsupportedLayout) as raised:
        layout.require_support(drafter, LAYERS)
    assert raised.value.layout == name and raised.value.reasons == reasons
    assert str(raised.value) == f"{name} layout cannot hold this drafter: {reasons[0]}"


def test_a_drafter_with_every_problem_gets_every_reason():
    drafter = _drafter(arch="qwen3", norm_before_residual=True, aux_layer_ids=[1, 2, LAYERS])
    assert len(layout_for("sglang").unsupported_reasons(drafter, LAYERS)) == 3


def test_an_unknown_layout_is_refused_before_anything_is_written(tmp_path):
    target = ensure_tiny("llama")
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt")
    with pytest.raises(UnsupportedLayout, match="unknown layout 'onnx'"):
        export_checkpoint(ckpt, target, tmp_path / "out", ["vllm", "onnx"])
    assert not (tmp_path / "out").exists()


def test_each_layout_validates_only_its_own_shape(tmp_path):
    """A folder written by one layout class fails every other class's validation."""
    target = ensure_tiny("llama")
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt", aux_layer_ids=[1, 2, 3])
    out = export_checkpoint(ckpt, target, tmp_path / "out", list(LAYOUTS))
    for written, folder in out.items():
        for name in LAYOUTS:
            problems = layout_for(name).validate(folder, target)
            assert (problems == []) == (name == written), (written, name, problems)
