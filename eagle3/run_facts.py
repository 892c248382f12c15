"""Facts of a run that more than one stage reads, resolved from the config and the run directory.

A stage never asks another stage's module where its input is or what made it: the prompt shards
prepare finished, the model name and chat template the target answers under, the request fields the
generation plan adds and the completion markers of tokenized and extracted shards are resolved here,
below every stage, and the orchestration (flows/, tasks/) and each stage read them from here. The
stage names are the ones each stage writes into its markers (a marker of another stage is refused).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.errors import MissingInputError
from eagle3.layout import RunLayout
from eagle3.markers import Marker, read_marker
from eagle3.models import resolve_model, served_name, template_hash
from eagle3.reasoning import request_extras_for

PREPARE, TOKENIZE, EXTRACT = "prepare", "tokenize", "extract"


def prepared_shards(config: PipelineConfig) -> dict[Path, int]:
    """The prompt shards named by prepare's completion marker, with their row counts."""
    layout = RunLayout.of(config)
    marker = read_marker(layout.prompts_marker, PREPARE)
    if marker is None:
        hint = "run the prepare stage first (eagle3 prepare, or eagle3 run)"
        raise MissingInputError("generate", layout.prompts_marker, hint)
    return {layout.prompt_shard(s["name"]): s["rows"] for s in marker["shards"]}


def expected_target(config: PipelineConfig) -> tuple[str, str]:
    """(model name requests use, template hash) as target_server will report them, without a server."""
    server = config.server
    if server.mode == "external":
        return server.served_model_name or server.model, ""
    path = resolve_model(server.model)
    return served_name(server.model, path, server.served_model_name), template_hash(path)


def request_plan(config: PipelineConfig) -> dict:
    """The keyword arguments of generate_shard / is_complete / generation_key that come from outside
    [generation]: the regenerate mode (data.turns) and the request fields the reasoning mode adds."""
    return {"regenerate": config.data.turns == "regenerate", "extras": request_extras_for(config) or None}


def read_tokenized_done(path: Path) -> Marker | None:
    """A tokenized shard's completion marker."""
    return read_marker(path, TOKENIZE)


def read_states_done(path: Path) -> Marker | None:
    """An extracted shard's completion marker (its stored hidden states)."""
    return read_marker(path, EXTRACT)
