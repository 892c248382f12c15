"""What every config section shares: the strict base model, the config error, where recipes live."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEMO_RECIPE = RECIPES_DIR / "tiny-demo.toml"  # what `make demo` runs; tests start from it too


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
