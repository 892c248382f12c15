"""The facts of a run that more than one stage reads, resolved once where the run starts.

``RunFacts.resolve(config)`` is called by whoever starts a run (the CLI, the parent flow, a stage's
flow run alone) and the object is handed down to every stage, which reads its inputs through it: a
stage never asks another stage's module where its input is or what made it.

Two kinds of facts:
- Resolved at the start, from the config and the target's files: the run layout, the target's local
  folder, the model name and chat-template hash generation keys records by, the tokenizer's folder and
  hash, the target's depth and width (so the tapped layer ids) and the request plan. Resolving reads
  small files only: no server starts, torch is not imported, and nothing is fetched over the network.
  A hub id the local cache lacks leaves the target's fields empty; the methods that need the files
  (``model_dir``, ``tokenizer``, ``expected_target``, ``target_shape``) then fetch them, which is what
  the first stage to read them did before (an external server needs none of them to generate).
- Written by a stage as the run proceeds, read from its markers through the layout: the prompt
  shards (prepare), each shard's tokenized and extracted marker, the layer ids extraction used. Asking
  for one before its stage ran is a ``MissingInputError`` naming the marker file and what to run.

The stage names are the ones each stage writes into its markers (a marker of another stage is refused).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3.config import PipelineConfig
from eagle3.errors import MissingInputError, UserError, run_first
from eagle3.layout import RunLayout
from eagle3.manifest import read_manifest
from eagle3.markers import Marker, read_marker
from eagle3.models import (
    declared_shape,
    local_model,
    resolve_layer_ids,
    resolve_model,
    served_name,
    target_shape,
    template_hash,
)
from eagle3.reasoning import request_extras_for
from eagle3.schemas import tokenizer_hash

PREPARE, TOKENIZE, EXTRACT = "prepare", "tokenize", "extract"


class RunFacts(BaseModel):
    """What a run's stages share, resolved once (see the module doc). Frozen; a Prefect flow takes it
    as a parameter (a subflow receives the object itself; the API stores its JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: PipelineConfig
    layout: RunLayout
    target_path: str | None  # the target's local folder; None: a hub id not in the local cache yet
    served_model: str  # the model name requests use and generation records carry
    template_hash: str | None  # the target's chat template ('' external / none); None: not fetched yet
    tokenizer_path: str | None  # tokenize.tokenizer, else the target's folder; None: not fetched yet
    tokenizer_hash: str  # eagle3.schemas.tokenizer_hash of that folder ('' when not fetched)
    target_layers: int | None  # the target's decoder layers, from its config.json
    target_hidden: int | None  # its hidden size
    regenerate: bool  # data.turns == "regenerate"
    extras: dict | None  # the request fields the reasoning mode adds

    @classmethod
    def resolve(cls, config: PipelineConfig) -> RunFacts:
        server = config.server
        path = local_model(server.model)
        tok_spec = config.tokenize.tokenizer or server.model
        tok_path = path if tok_spec == server.model else local_model(tok_spec)
        if server.mode == "external":  # the server names the model; its template is not ours to read
            served, template = server.served_model_name or server.model, ""
        else:
            served = served_name(server.model, path or "", server.served_model_name)
            template = template_hash(path) if path is not None else None
        shape = declared_shape(path) if path is not None else None
        return cls(
            config=config,
            layout=RunLayout.of(config),
            target_path=path,
            served_model=served,
            template_hash=template,
            tokenizer_path=tok_path,
            tokenizer_hash=tokenizer_hash(tok_path) if tok_path is not None else "",
            target_layers=shape[0] if shape else None,
            target_hidden=shape[1] if shape else None,
            regenerate=config.data.turns == "regenerate",
            extras=request_extras_for(config) or None,
        )

    @classmethod
    def of(cls, config: PipelineConfig, facts: RunFacts | None = None) -> RunFacts:
        """``facts`` when the caller resolved them (checked to be this config's), else resolved now."""
        if facts is None:
            return cls.resolve(config)
        if facts.config != config:
            raise UserError(f"the run's facts were resolved for another config (run_dir {facts.config.run_dir!r})")
        return facts

    # -- the target and its tokenizer ------------------------------------------------------------

    def model_dir(self) -> str:
        """The target's local folder (fetched into the hub cache when resolving found none)."""
        return self.target_path or resolve_model(self.config.server.model)

    def tokenizer(self) -> tuple[str, str]:
        """(the tokenizer's local folder, its hash)."""
        if self.tokenizer_path is not None:
            return self.tokenizer_path, self.tokenizer_hash
        path = resolve_model(self.config.tokenize.tokenizer or self.config.server.model)
        return path, tokenizer_hash(path)

    def expected_target(self) -> tuple[str, str]:
        """(model name requests use, template hash) as the target's server will report them."""
        if self.template_hash is not None:
            return self.served_model, self.template_hash
        path = self.model_dir()
        return served_name(self.config.server.model, path, self.config.server.served_model_name), template_hash(path)

    def target_shape(self) -> tuple[int, int]:
        """(num_hidden_layers, hidden_size) of the target."""
        if self.target_layers is not None and self.target_hidden is not None:
            return self.target_layers, self.target_hidden
        return target_shape(self.model_dir())

    @property
    def layer_ids(self) -> list[int]:
        """The tapped layers (vLLM numbering): extract.layer_ids checked against the target, else the
        default for its depth. A LayerIdError when they do not fit."""
        return resolve_layer_ids(self.config.extract.layer_ids, self.target_shape()[0])

    @property
    def request_plan(self) -> dict:
        """The keyword arguments of generate_shard / is_complete / generation_key that come from outside
        [generation]: the regenerate mode (data.turns) and the request fields the reasoning mode adds."""
        return {"regenerate": self.regenerate, "extras": self.extras}

    # -- facts the stages write as the run proceeds ------------------------------------------------

    def prompt_shards(self, needed_by: str = "generate") -> dict[Path, int]:
        """The prompt shards named by prepare's completion marker, with their row counts."""
        marker = read_marker(self.layout.prompts_marker, PREPARE)
        if marker is None:
            hint = "run the prepare stage first (eagle3 prepare, or eagle3 run)"
            raise MissingInputError(needed_by, self.layout.prompts_marker, hint)
        return {self.layout.prompt_shard(s["name"]): s["rows"] for s in marker["shards"]}

    def shard_names(self, needed_by: str = "generate") -> list[str]:
        """The shard file names every later stage works through (``shard-00000.parquet``...): one per
        prompt shard, the same name in tokenized/."""
        return [path.name for path in self.prompt_shards(needed_by)]

    def tokenized_done(self, shard: str | Path) -> Marker | None:
        """A tokenized shard's completion marker (None: not tokenized)."""
        return read_tokenized_done(self.layout.tokenized_files(shard)["done"])

    def tokenized_marker(self, shard: str | Path, needed_by: str) -> Marker:
        """A tokenized shard's completion marker, or the MissingInputError naming it."""
        marker = self.tokenized_done(shard)
        if marker is None:
            path = self.layout.tokenized_files(shard)["done"]
            problem = f"not found: shard {Path(shard).name} has not been tokenized"
            raise MissingInputError(needed_by, path, run_first("eagle3 tokenize"), problem)
        return marker

    def states_done(self, shard: str | Path) -> Marker | None:
        """An extracted shard's completion marker (None: its states are not stored)."""
        return read_states_done(self.layout.states_files(shard)["done"])

    def extracted_layer_ids(self, needed_by: str = "train") -> list[int]:
        """The layer ids the extract stage used (its manifest entry), checked against the config."""
        entry = read_manifest(self.layout.root).get("stages", {}).get(EXTRACT)
        if not entry:
            hint, problem = run_first("eagle3 extract"), "has no extract stage"
            raise MissingInputError(needed_by, self.layout.manifest, hint, problem)
        extract = self.config.extract
        if extract.layer_ids and list(extract.layer_ids) != entry["layer_ids"]:
            problem = f"{extract.layer_ids} differ from the {entry['layer_ids']} the extract stage used"
            raise MissingInputError(needed_by, "extract.layer_ids", run_first("eagle3 extract", again=True), problem)
        if entry.get("mode") != extract.mode:
            problem = f"is {extract.mode!r} but the extract stage ran in {entry.get('mode')!r} mode"
            raise MissingInputError(needed_by, "extract.mode", run_first("eagle3 extract", again=True), problem)
        return list(entry["layer_ids"])


def read_tokenized_done(path: Path) -> Marker | None:
    """A tokenized shard's completion marker, by its path (the training workers read it so: they get
    the run's config, not its facts)."""
    return read_marker(path, TOKENIZE)


def read_states_done(path: Path) -> Marker | None:
    """An extracted shard's completion marker (its stored hidden states), by its path."""
    return read_marker(path, EXTRACT)
