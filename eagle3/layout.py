"""Every path of a run directory, named in one place.

A run directory holds one folder per stage (docs/design.md, "The run directory"). Stages,
the CLI, the report and the tasks ask ``RunLayout`` for a path instead of joining names by hand,
so a folder or file name is written once. The names on disk are those of earlier releases: an
existing run directory keeps working.

Per-shard files are named after the shard's stem (``shard-00000.parquet`` -> ``shard-00000``).
Completion markers (``eagle3/markers.py``) are ``STEM.done.json`` per shard and ``done.json`` for
a whole stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER_SUFFIX = ".done.json"
STAGE_MARKER = "done.json"
LEGACY_STAGE_MARKER = "_SUCCESS.json"  # the whole-stage marker's name in earlier releases


def stem(shard: str | Path) -> str:
    """``shard-00000`` for ``shard-00000.parquet`` (or a path to it)."""
    return Path(shard).name.removesuffix(".parquet")


def marker_path(folder: str | Path, unit: str | Path | None = None) -> Path:
    """The completion marker of one shard (``unit``: its name or stem) or, without one, of the whole stage."""
    return Path(folder) / (f"{stem(unit)}{MARKER_SUFFIX}" if unit is not None else STAGE_MARKER)


def generation_files(folder: str | Path, shard: str | Path) -> dict[str, Path]:
    """One prompt shard's generation files in ``folder`` (RUN/generations, or a folder a test chooses)."""
    s, folder = stem(shard), Path(folder)
    names = {
        "ok": ".jsonl",
        "filtered": ".filtered.jsonl",
        "failed": ".failed.jsonl",
        "meta": ".meta.json",
        "lock": ".lock",
    }
    return {**{k: folder / f"{s}{suffix}" for k, suffix in names.items()}, "done": marker_path(folder, s)}


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory. Building one touches nothing on disk."""

    root: Path

    @classmethod
    def of(cls, where: Any) -> RunLayout:
        """From a run directory (str or Path) or anything with a ``run_dir`` (a PipelineConfig)."""
        return cls(Path(getattr(where, "run_dir", where)))

    def stage_dir(self, name: str) -> Path:
        """A stage's folder by its folder name (``generations``, ``prompts``, ...)."""
        return self.root / name

    # -- the run as a whole ------------------------------------------------------------------

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def manifest_lock(self) -> Path:
        return self.root / ".manifest.json.lock"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    # -- prepare -----------------------------------------------------------------------------

    @property
    def prompts(self) -> Path:
        return self.root / "prompts"

    def prompt_shard(self, shard: str | Path) -> Path:
        return self.prompts / f"{stem(shard)}.parquet"

    @property
    def prompts_rejected(self) -> Path:
        return self.prompts / "rejected.jsonl"

    @property
    def prompts_marker(self) -> Path:
        return marker_path(self.prompts)

    @property
    def self_prompts(self) -> Path:
        return self.prompts / "self"

    @property
    def self_prompts_file(self) -> Path:
        return self.self_prompts / "prompts.jsonl"

    @property
    def self_prompts_rejected(self) -> Path:
        return self.self_prompts / "rejected.jsonl"

    @property
    def self_prompts_marker(self) -> Path:
        return marker_path(self.self_prompts)

    def self_prompts_requests(self, key: str) -> Path:
        return self.self_prompts / f"requests-{key}.jsonl"

    # -- generate ----------------------------------------------------------------------------

    @property
    def generations(self) -> Path:
        return self.root / "generations"

    def generation(self, shard: str | Path) -> dict[str, Path]:
        """ok / filtered / failed streams, meta, lock and done marker of one shard."""
        return generation_files(self.generations, shard)

    def stale_generations(self, key: str) -> Path:
        return self.generations / f"stale-{key}"

    def server_log(self, folder: str = "generations") -> Path:
        return self.stage_dir(folder) / "server.log"

    def replica_events(self, folder: str = "generations") -> Path:
        return self.stage_dir(folder) / "replica-events.jsonl"

    # -- tokenize ----------------------------------------------------------------------------

    @property
    def tokenized(self) -> Path:
        return self.root / "tokenized"

    def tokenized_files(self, shard: str | Path) -> dict[str, Path]:
        """parquet, counts, rejected and done marker of one tokenized shard."""
        s = stem(shard)
        return {
            "parquet": self.tokenized / f"{s}.parquet",
            "counts": self.tokenized / f"{s}.counts.safetensors",
            "rejected": self.tokenized / f"{s}.rejected.jsonl",
            "done": marker_path(self.tokenized, s),
        }

    # -- vocab -------------------------------------------------------------------------------

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def draft_vocab(self) -> Path:
        return self.vocab / "draft_vocab.safetensors"

    @property
    def vocab_marker(self) -> Path:
        return marker_path(self.vocab)

    # -- extract -----------------------------------------------------------------------------

    @property
    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    def states_files(self, shard: str | Path) -> dict[str, Path]:
        """states (safetensors), index and done marker of one shard."""
        s = stem(shard)
        return {
            "states": self.hidden_states / f"{s}.safetensors",
            "index": self.hidden_states / f"{s}.index.json",
            "done": marker_path(self.hidden_states, s),
        }

    def vllm_work(self, shard: str | Path) -> Path:
        """The vLLM extraction worker's scratch folder for one shard (removed after)."""
        return self.hidden_states / f".vllm-{stem(shard)}"

    @property
    def online(self) -> Path:
        return self.hidden_states / "online.json"

    # -- train -------------------------------------------------------------------------------

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def train_request(self) -> Path:
        return self.train / "request.json"

    @property
    def train_result(self) -> Path:
        return self.train / "result.json"

    @property
    def train_log(self) -> Path:
        return self.train / "log.jsonl"

    @property
    def train_eval(self) -> Path:
        return self.train / "eval.jsonl"

    @property
    def train_curves(self) -> Path:
        return self.train / "curves.png"

    @property
    def torchrun_pid(self) -> Path:
        return self.train / "torchrun.pid"

    @property
    def train_nodes(self) -> Path:
        """The Ray nodes the last training attempt on the cluster ran on (a retry looks for them)."""
        return self.train / "cluster_nodes.json"

    @property
    def train_marker(self) -> Path:
        return marker_path(self.train)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_checkpoint(self) -> Path:
        """The resume pointer: which step folder to resume from (not a completion marker)."""
        return self.checkpoints / "latest.json"

    @property
    def best_checkpoint(self) -> Path:
        return self.checkpoints / "best.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    # -- export and evaluate -----------------------------------------------------------------

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def export_marker(self) -> Path:
        return marker_path(self.export)

    def export_layout(self, name: str) -> Path:
        return self.export / name

    @property
    def evaluate(self) -> Path:
        return self.root / "evaluate"

    @property
    def live(self) -> Path:
        return self.evaluate / "live.json"
