"""The whole pipeline's config: one run directory and a section per stage."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from eagle3.config.base import _Strict
from eagle3.config.cluster import ClusterConfig
from eagle3.config.data import DataConfig
from eagle3.config.evaluate import EvaluateConfig
from eagle3.config.export import ExportConfig
from eagle3.config.serving import GenerationConfig, ServerConfig
from eagle3.config.training import ExtractConfig, TokenizeConfig, TrainConfig, VocabConfig


class PipelineConfig(_Strict):
    """The whole pipeline: one run directory and a section per stage."""

    run_dir: str = Field(
        "runs/eagle3",
        description=(
            "Every stage writes under this folder, one subfolder per stage; a rerun with the same folder resumes."
        ),
    )
    data: DataConfig = Field(default_factory=DataConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_section_names(cls, data: Any) -> Any:
        """``[hidden_states]`` is the old name of ``[extract]``: still read, with a warning, so old
        configs and deployments keep working; both at once is ambiguous and refused."""
        if isinstance(data, dict) and "hidden_states" in data:
            if "extract" in data:
                raise ValueError(
                    "both [extract] and [hidden_states] are set: hidden_states is the old name of extract; keep only "
                    "[extract]"
                )
            warnings.warn(
                "config section [hidden_states] is deprecated: rename it to [extract] (same keys)",
                FutureWarning,
                stacklevel=2,
            )
            data = {("extract" if k == "hidden_states" else k): v for k, v in data.items()}
        return data

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_safe(cls, run_dir: str) -> str:
        """Stages delete their own temporary files under run_dir: refuse folders where that could
        touch someone else's files. The path is checked as given and with ~ expanded."""
        from eagle3.durable import unsafe_root_reason

        for candidate in dict.fromkeys((run_dir, str(Path(run_dir).expanduser()))):
            reason = unsafe_root_reason(Path(candidate).absolute()) if run_dir.strip() else "it is empty"
            if reason is not None:
                raise ValueError(
                    f"run_dir {run_dir!r} is not a safe run directory: {reason}. Use a folder of its own, e.g. "
                    "runs/NAME"
                )
        return run_dir

    @model_validator(mode="after")
    def _cluster_clients_reach_the_server(self):
        loopback = self.server.host in ("127.0.0.1", "localhost", "::1")
        if self.cluster.runs("generate") and self.server.mode == "managed" and self.server.replicas == 1 and loopback:
            raise ValueError(
                f"cluster.stages includes generate, but the managed server listens on server.host = "
                f"{self.server.host!r}, which generation tasks on other nodes cannot reach: set server.replicas > 1 "
                "(replicas on the cluster listen on their node's address), an address other nodes reach in "
                "server.host, or leave generate off cluster.stages"
            )
        return self

    @model_validator(mode="after")
    def _multi_node_needs_an_endpoint(self):
        t = self.train
        if t.nnodes > 1 and not self.cluster.runs("train"):  # on the cluster, the pipeline sets the rendezvous
            host, _, port = t.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"train.nnodes={t.nnodes} needs train.rdzv_endpoint as host:port of node 0 "
                    f"(got {t.rdzv_endpoint!r}), "
                    'e.g. --set train.rdzv_endpoint="node0:29400", or a cluster.address with train in cluster.stages'
                )
        return self

    @model_validator(mode="after")
    def _compiled_needs_eager(self):
        compiled = [m for m in self.evaluate.methods if m.endswith("_compiled")]
        if compiled and "--enforce-eager" not in self.server.args:
            raise ValueError(
                f"evaluate.methods {compiled}: a *_compiled method serves without --enforce-eager, but server.args "
                f"does not pass --enforce-eager, so the plain methods are compiled already; drop the *_compiled ones"
            )
        return self


def section_hash(section: BaseModel) -> str:
    """A stable hash of one config section, for cache keys and manifests. Keys a section lists in its
    ``LATER_KEYS`` (added after runs were on disk, with their defaults) are left out while they hold that
    default, so a config written before them hashes as before and its markers stay current."""
    dump = section.model_dump(mode="json")
    for key, default in getattr(type(section), "LATER_KEYS", {}).items():
        if key in dump and dump[key] == default:
            del dump[key]
    text = json.dumps(dump, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
