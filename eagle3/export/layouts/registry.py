"""Layout names (the values of ``export.formats``) -> the classes that write and check them."""

from __future__ import annotations

from pathlib import Path

from eagle3.export.layouts.base import Layout
from eagle3.export.layouts.files import ExportError
from eagle3.export.layouts.sglang import SglangLayout
from eagle3.export.layouts.speculators import SpeculatorsLayout
from eagle3.export.layouts.vllm import VllmLayout

LAYOUT_CLASSES: dict[str, type[Layout]] = {cls.name: cls for cls in (VllmLayout, SglangLayout, SpeculatorsLayout)}
LAYOUTS = tuple(LAYOUT_CLASSES)


def _unknown(name: str) -> str:
    return f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})"


def layout_for(name: str) -> Layout:
    """The layout called ``name``; ExportError naming the known ones when there is none."""
    if name not in LAYOUT_CLASSES:
        raise ExportError(_unknown(name))
    return LAYOUT_CLASSES[name]()


def unsupported_reasons(name: str, drafter_config, num_target_layers: int) -> list[str]:
    """Why layout ``name`` cannot hold this drafter ([] = it can); an unknown name is one such reason."""
    if name not in LAYOUT_CLASSES:
        return [_unknown(name)]
    return layout_for(name).unsupported_reasons(drafter_config, num_target_layers)


def validate_export(folder: str | Path, name: str, target_path: str | Path) -> list[str]:
    """Load an export of layout ``name`` back and check it against the target; [] when it is sound."""
    if name not in LAYOUT_CLASSES:
        return [f"unknown layout {name!r}"]
    return layout_for(name).validate(folder, target_path)
