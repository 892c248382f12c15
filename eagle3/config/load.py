"""Loading a config (defaults, a TOML file, ``--set`` items), laying one tree on another, and
rendering a config back as TOML (``eagle3 config show``)."""

from __future__ import annotations

import difflib
import json
import textwrap
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from eagle3.config.base import ConfigError
from eagle3.config.pipeline import PipelineConfig


def parse_set(item: str) -> tuple[list[str], Any]:
    """Split ``a.b=value``; the value is a TOML literal when it parses as one, else a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set generation.concurrency=64")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _apply_set(tree: dict, path: list[str], value: Any, item: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _allowed_keys(loc), n=1)
        extra = f" (did you mean {'.'.join([*map(str, loc[:-1]), hint[0]])}?)" if hint else ""
        return f"{key}: unknown key{extra}"
    if (
        len(loc) <= 1 and err["type"] == "value_error"
    ):  # between keys of a section: the message names them and their values
        return f"{key}: {err['msg'].removeprefix('Value error, ')}"
    return f"{key}: {err['msg']} (got {err.get('input')!r})"


def _validate(tree: dict, where: str, fields_only: bool = False) -> PipelineConfig | None:
    """``fields_only``: report only errors of single keys (what one ``--set`` item can cause) and
    leave those between keys of a section (``train.nnodes`` needs ``train.rdzv_endpoint``) to the
    final check, so a pair of ``--set`` items can be given in either order."""
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if not (fields_only and len(e["loc"]) <= 1 and e["type"] == "value_error")]
        if not errors:
            return None
        lines = [f"{where}: {_describe(e)}" for e in errors]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def overlay(base: dict, over: dict) -> dict:
    """``over`` laid on ``base`` key by key, sections merged rather than replaced (a recipe plus
    a few changes, as Prefect parameters or deployment files need them)."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            overlay(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def load_config(path: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Embedded defaults, overlaid by a TOML file, overlaid by ``--set`` items.

    The file is validated on its own first so an error names the file; then each
    ``--set`` is applied so an error there names the ``--set`` item.
    """
    tree: dict = read_toml(path) if path is not None else {}
    _validate(tree, str(path) if path is not None else "defaults")
    for item in sets:
        keys, value = parse_set(item)
        _apply_set(tree, keys, value, item)
        _validate(tree, f"--set {item}", fields_only=True)
    return _validate(tree, "config")


def to_toml(config: BaseModel, docs: bool = False) -> str:
    """Render a config as TOML (what ``eagle3 config show`` prints); ``docs`` adds each key's description."""
    lines: list[str] = []
    _render_section(config, "", lines, docs)
    return "\n".join(lines).lstrip("\n") + "\n"


def _render_section(model: BaseModel, prefix: str, lines: list[str], docs: bool) -> None:
    """Plain keys first, then each sub-model as its own table ([data], then [data.self_prompts])."""
    _render_fields(model, lines, docs)
    for name in type(model).model_fields:
        section = getattr(model, name)
        if isinstance(section, BaseModel):
            lines.append(f"\n[{prefix}{name}]")
            _render_section(section, f"{prefix}{name}.", lines, docs)


def _render_fields(model: BaseModel, lines: list[str], docs: bool) -> None:
    for key, field in type(model).model_fields.items():
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            continue
        if docs and field.description:
            lines.extend("# " + chunk for chunk in textwrap.wrap(field.description, 100))
        plain = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        lines.append(f"# {key} = (unset)" if plain is None else f"{key} = {_toml_value(plain)}")


def _toml_value(value: Any) -> str:
    if isinstance(value, BaseModel):  # an entry of a list of tables (data.mix); unset keys are left out
        value = value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")
