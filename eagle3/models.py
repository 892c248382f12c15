"""Naming the target model: local folders, hub ids, and the tiny offline models.

Every stage that reads the target's files (tokenizer, config, weights) calls ``resolve_model``
and gets a local folder, so no stage has to know where a model came from:

- a local folder is used as written;
- ``tiny:ARCH`` is built on demand into the project's cache;
- a hub id (``org/name``, optionally ``org/name@REVISION``) is looked up in the local Hugging
  Face cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), read
  from the environment at each call so a process can point it elsewhere. A cached snapshot is
  used as is, without asking the hub for a newer one: a run reads the same bytes in every
  stage and on every rerun. Offline (``HF_HUB_OFFLINE=1``) and not cached is a
  ``ModelNotFoundError`` naming the id and the fix. Online and not cached, the model's config,
  tokenizer, chat template and safetensors weights are downloaded once into that cache
  (nothing else: no ``*.bin``/``*.pth`` duplicates, no GGUF), each request under an explicit
  deadline; the download is what ``vllm serve ID`` would have done, and after it every stage
  reads the same snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from pathlib import Path

from eagle3.errors import LayerIdError, TransientError, UserError

TINY_PREFIX = "tiny:"

# What a stage or vLLM reads from a model repository. Weights only as safetensors: training,
# export and extraction read safetensors, and repos that also ship *.bin / original/*.pth
# would double or triple the download.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
# Seconds for each hub request that checks a file's metadata; a stalled connection fails
# instead of hanging a stage. Each download read is bounded by huggingface_hub's own
# HF_HUB_DOWNLOAD_TIMEOUT (10 s unless the environment sets it).
HUB_REQUEST_TIMEOUT_S = 30.0
_TRUE = {"1", "ON", "YES", "TRUE"}
# A hub id as the hub spells one: [org/]name, then an optional @revision (branch, tag or commit).
_HUB_ID = re.compile(r"^(?P<repo>(?:[\w.-]+/)?[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
_DOWNLOAD_LOCK = threading.Lock()


class ModelNotFoundError(UserError, ValueError):
    """The target named in the config is no local folder and no hub model we may use (permanent)."""


class ModelDownloadError(TransientError, OSError):
    """Downloading a hub model failed on the way (network, disk); a retry may succeed."""


def resolve_model(spec: str) -> str:
    """A local folder holding the model ``spec`` names (see the module doc for the three kinds)."""
    if spec.startswith(TINY_PREFIX):
        from eagle3.tiny import ensure_tiny

        return str(ensure_tiny(spec[len(TINY_PREFIX) :]))
    if Path(spec).expanduser().is_dir():
        return spec
    repo_id, revision = parse_hub_id(spec)
    return str(hub_snapshot(repo_id, revision))


def local_model(spec: str) -> str | None:
    """The local folder ``spec`` names without any network call: a folder, a tiny build (built on
    first use), a hub id already in the cache; None for a hub id the cache lacks and for a name that
    is no model we could find (an external server's own name: ``resolve_model`` says why when asked)."""
    if spec.startswith(TINY_PREFIX) or Path(spec).expanduser().is_dir():
        return resolve_model(spec)
    if not is_hub_id(spec):
        return None
    repo_id, revision = parse_hub_id(spec)
    cached = cached_snapshot(repo_id, revision)
    return None if cached is None else str(cached)


def is_hub_id(spec: str) -> bool:
    """True when ``spec`` names a hub model (not ``tiny:``, not an existing local folder)."""
    if spec.startswith(TINY_PREFIX) or Path(spec).expanduser().is_dir():
        return False
    return _HUB_ID.match(spec) is not None and ".." not in spec and "--" not in spec


def served_name(spec: str, path: str, served_model_name: str | None = None) -> str:
    """The model name requests to a managed server use and generation records carry.

    A hub id keeps its id: the managed server loads the resolved snapshot folder but is told
    ``--served-model-name ID``, which is also the name an external server for that id reports,
    so records and the tokenize stage's "made by another model" check read the same in both
    modes and do not change with the cache's location. Local folders and tiny builds keep
    their folder path (their existing runs' keys stay valid)."""
    return served_model_name or (spec if is_hub_id(spec) else path)


def parse_hub_id(spec: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of ``org/name[@rev]``; anything else is not a model we can find."""
    match = _HUB_ID.match(spec)
    if not match or ".." in spec or "--" in spec or len(match["repo"]) > 96:
        raise ModelNotFoundError(
            f"model {spec!r}: no such local folder, and not a Hugging Face hub id (org/name or org/name@revision): "
            "set server.model to a model folder or a hub id"
        )
    return match["repo"], match["rev"]


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub uses, from the environment now (it reads it at import)."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub_cache:
        return Path(os.path.expandvars(hub_cache)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    return any((os.environ.get(name) or "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (default: main), downloaded
    first when the hub is reachable and allowed and the cache lacks it."""
    cached = cached_snapshot(repo_id, revision)
    if cached is not None:
        return cached
    named = repo_id + (f"@{revision}" if revision else "")
    if hub_offline():
        raise ModelNotFoundError(
            f"model {named!r} is not in the Hugging Face cache {hub_cache_dir()} and the hub is offline "
            "(HF_HUB_OFFLINE): download it on a connected machine with `hf download "
            f"{repo_id}{f' --revision {revision}' if revision else ''}` into this cache (or set HF_HUB_CACHE / "
            "HF_HOME to the cache that holds it), or set server.model to a local model folder"
        )
    return _download(repo_id, revision, named)


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cache's snapshot folder, if it holds one with a config.json; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None
    # A snapshot left by `hf download ID some-file` alone is not a model.
    return folder if (folder / "config.json").is_file() else None


def _download(repo_id: str, revision: str | None, named: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    with _DOWNLOAD_LOCK:  # one download per process; huggingface_hub's file locks cover other processes
        cached = cached_snapshot(repo_id, revision)
        if cached is not None:
            return cached
        try:
            folder = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                allow_patterns=MODEL_FILES,
                etag_timeout=HUB_REQUEST_TIMEOUT_S,
            )
        except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
            raise ModelNotFoundError(
                f"model {named!r}: the hub refused it ({type(exc).__name__}): check the id, and for a "
                f"gated model accept its licence and set HF_TOKEN"
            ) from exc
        except (HfHubHTTPError, OSError) as exc:
            raise ModelDownloadError(
                f"model {named!r} is not in the Hugging Face cache {hub_cache_dir()} and downloading it "
                f"failed: {exc}. Run `hf download {repo_id}` or set server.model to a local folder"
            ) from exc
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"model {named!r}: the downloaded snapshot {folder} has no config.json (not a transformers model)"
        )
    return folder


def template_hash(model_path: str) -> str:
    """A hash of the chat template a local model folder ships, so a new template means new
    generations; '' when ``model_path`` is not a folder."""
    if not Path(model_path).is_dir():
        return ""
    text = chat_template_text(model_path)
    return hashlib.sha256(str(text).encode()).hexdigest()[:16] if text else ""


def chat_template_text(model_path: str) -> str:
    """The chat template a local model folder ships ('' when none is found)."""
    folder = Path(model_path)
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    return str(json.loads(config.read_text()).get("chat_template", "") or "") if config.exists() else ""


def reasoning_parser(setting: str | None, model_path: str) -> str | None:
    """The --reasoning-parser for this target: ``auto`` asks its chat template (a <think> block
    means a Qwen3-style thinking model); a name passes through; '' or None means none."""
    if not setting:
        return None
    if setting != "auto":
        return setting
    return "qwen3" if "<think>" in chat_template_text(model_path) else None


def vllm_launcher(server) -> list[str]:
    """The command that starts vLLM's OpenAI server: ``server.command``, else ``server.python -m ...``
    (default: this interpreter, where the ``gpu`` extra installs vllm)."""
    import sys

    return (
        list(server.command)
        if server.command
        else [server.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    )


# vLLM's switch for uvicorn's per-request access log (server.access_log = false, the default).
ACCESS_LOG_FLAG = "--disable-uvicorn-access-log"


def vllm_args(server, model_path: str) -> list[str]:
    """``server.args`` plus the model-dependent flags the config leaves to the model itself."""
    args = list(server.args)
    if not server.access_log and not any(a.startswith(ACCESS_LOG_FLAG) for a in args):
        args.append(ACCESS_LOG_FLAG)
    if not any(a == "--reasoning-parser" or a.startswith("--reasoning-parser=") for a in args):
        parser = reasoning_parser(server.reasoning_parser, model_path)
        if parser:
            args += ["--reasoning-parser", parser]
    return args


# -- the target's shape and the layers an EAGLE-3 drafter taps -------------------------------------


def declared_shape(model_path: str) -> tuple[int, int] | None:
    """(num_hidden_layers, hidden_size) from a model folder's config.json (its ``text_config`` for a
    multimodal model), read as a file: None when the folder or the keys are missing."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    return (int(layers), int(hidden)) if isinstance(layers, int) and isinstance(hidden, int) else None


def target_shape(model_path: str) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) of the target, from its config alone (no weights loaded):
    config.json as a file, else transformers' reading of it (configs that name the keys otherwise)."""
    shape = declared_shape(model_path)
    if shape is not None:
        return shape
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers), int(text.hidden_size)


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default (2, L//2, L-3) where those are three distinct layers, else
    (1, L//2, L-1): for a 4-layer target vLLM's choice collapses to two layers."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    ids = [1, num_layers // 2, num_layers - 1]
    if len(set(ids)) != 3 or min(ids) < 1:
        raise LayerIdError(
            f"a target with {num_layers} layers has no three distinct auxiliary layers; set extract.layer_ids"
        )
    return ids


def resolve_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The tapped layers: ``extract.layer_ids`` when set (checked against the target), else the default."""
    ids = list(configured) if configured else default_layer_ids(num_layers)
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise LayerIdError(
            f"extract.layer_ids {ids}: {bad} outside 1..{num_layers} (the target has {num_layers} decoder "
            "layers; vLLM numbering)"
        )
    return ids
