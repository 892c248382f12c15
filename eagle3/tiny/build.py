"""Assemble, save and cache the tiny model directory.

A build is written into a fresh temp dir beside its destination and renamed
into place at the end, so a killed build never leaves a half directory and
two racing ``ensure_tiny`` calls cannot corrupt each other (the loser's rename
fails and it discards its own copy). A marker file written last tells a
complete tiny build apart from any other directory.

The model is instantiated once in float32 to measure what its final norm feeds
``lm_head`` (see weights.py), then cast to bfloat16 and saved. The global torch
RNG is left untouched: all randomness comes from the builder's own generator.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

from eagle3.tiny.specs import (
    HEAD_DIM,
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MAX_POSITIONS,
    NUM_HEADS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    THINK_END,
    THINK_START,
    VOCAB_MULTIPLE,
    ArchSpec,
    get_spec,
)

# Bump whenever anything the builder writes changes: cached builds are keyed by it.
BUILD_VERSION = "2"
MARKER = "eagle3_tiny.json"
CACHE_ENV = "EAGLE3_CACHE_DIR"


def build_tiny(out_dir, arch: str = "qwen3", tie_embeddings: bool = False) -> Path:
    """Build the tiny ``arch`` model directory at ``out_dir`` and return its path.

    An existing empty directory or earlier tiny build at ``out_dir`` is
    replaced; anything else there raises ``FileExistsError`` (never delete a
    user's files). ``tie_embeddings``: a tied target like SmolLM2 (see ``tie_head``).
    """
    spec = get_spec(arch)
    out = Path(out_dir).expanduser().absolute()
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_dir(out.parent, f".{out.name}.tmp")
    try:
        write_model_dir(spec, tmp)
        if tie_embeddings:
            tie_head(tmp)
        swap_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny(arch: str = "qwen3", cache_dir=None) -> Path:
    """The cached tiny build for ``arch``, built on first use."""
    spec = get_spec(arch)
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3-pipeline")
    target = root.expanduser().absolute() / f"tiny-{spec.name}-{version_hash()}"
    if is_tiny_build(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = fresh_dir(target.parent, f".{target.name}.tmp")
    try:
        write_model_dir(spec, tmp)
        os.rename(tmp, target)
    except OSError:
        # Another process renamed its copy in first; use that one.
        if not is_tiny_build(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def fresh_dir(parent: Path, prefix: str) -> Path:
    # Not mkdtemp: its 0700 mode would end up on the published model directory.
    path = parent / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def version_hash() -> str:
    return hashlib.sha256(BUILD_VERSION.encode()).hexdigest()[:10]


def is_tiny_build(path: Path) -> bool:
    return (path / MARKER).is_file()


def check_replaceable(out: Path) -> None:
    if out.exists() and not (out.is_dir() and (is_tiny_build(out) or not any(out.iterdir()))):
        raise FileExistsError(f"{out} exists and is not a tiny build or an empty directory")


def swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first.
    old = fresh_dir(out.parent, f".{out.name}.old")
    os.rename(out, old / "dir")
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def write_model_dir(spec: ArchSpec, out: Path) -> None:
    from eagle3.tiny.tokenizer import build_tokenizer, save_tokenizer

    hf_tok = build_tokenizer(spec)
    model = build_model(spec, hf_tok)
    with quiet_progress():
        model.save_pretrained(str(out))
    save_tokenizer(hf_tok, out)
    marker = {"arch": spec.name, "build_version": BUILD_VERSION}
    (out / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    file_mode = out.stat().st_mode & 0o666
    for f in out.iterdir():
        f.chmod(file_mode)  # some writers create 0600 files; match the directory's umask


def tie_head(out: Path) -> None:
    """Make the saved model a tied one, as SmolLM2 or Gemma ship: no ``lm_head.weight`` in the
    safetensors and ``tie_word_embeddings: true``, so the embedding is the head.

    The embedding stays and the shaped head is dropped, so a tied build keeps its inputs but
    loses the calibrated think/stop rates of weights.py: it is for the train and export paths,
    not for sampling demos."""
    from safetensors.torch import load_file, save_file

    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["lm_head.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # Only a tied build carries these keys: the default build stays byte-identical.
    for name, key in (("config.json", "tie_word_embeddings"), (MARKER, "tie_embeddings")):
        path = out / name
        data = json.loads(path.read_text(encoding="utf-8"))
        data[key] = True
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def quiet_progress():
    """Hide transformers' progress bar for the save, restoring the caller's setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def padded_vocab(n_tokens: int) -> int:
    return -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def token_roles(spec: ArchSpec, hf_tok, vocab_size: int):
    from eagle3.tiny.weights import TokenRoles

    ids = hf_tok.convert_tokens_to_ids
    never = [t for t in (*spec.specials, THINK_START) if t != spec.eos]
    padding_rows = range(len(hf_tok), vocab_size)
    return TokenRoles(
        eos=ids(spec.eos),
        think_end=ids(THINK_END),
        triggers=tuple(ids(t) for t in spec.answer_triggers),
        forbidden=tuple(ids(never)) + tuple(padding_rows),
    )


def hf_config(spec: ArchSpec, hf_tok, vocab_size: int):
    from transformers import AutoConfig

    ids = hf_tok.convert_tokens_to_ids
    return AutoConfig.for_model(
        spec.model_type,
        architectures=[spec.architecture],
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTERMEDIATE_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=ids(spec.bos) if spec.bos else None,
        eos_token_id=ids(spec.eos),
        pad_token_id=ids(spec.pad),
        dtype="bfloat16",
    )


def generation_config(config):
    from transformers import GenerationConfig

    # Qwen3's recommended thinking-mode sampling; no top_k, which would silently
    # change the distribution the stop/think rates were calibrated on.
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
    )


def build_model(spec: ArchSpec, hf_tok, knobs=None):
    """The bfloat16 HF model with shaped weights, ready to save."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.tiny import weights
    from eagle3.tiny.tokenizer import corpus_token_counts

    vocab_size = padded_vocab(len(hf_tok))
    roles = token_roles(spec, hf_tok, vocab_size)
    knobs = knobs or weights.Knobs()
    config = hf_config(spec, hf_tok, vocab_size)
    sd = weights.build_state_dict(spec.model_type, vocab_size, roles, knobs)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(sd, strict=True)
    model.eval()
    stats = weights.measure_reserved(model, *probe_ids(spec, hf_tok))
    prior = weights.unigram_offsets(corpus_token_counts(hf_tok.backend_tokenizer), vocab_size, knobs.unigram_weight)
    with torch.no_grad():
        weights.shape_logits(model.lm_head.weight, stats, roles, prior, knobs)
    model.generation_config = generation_config(config)
    return model.to(torch.bfloat16)


def probe_ids(spec: ArchSpec, hf_tok, n_docs: int = 24) -> tuple[list[int], list[int]]:
    """Token ids without any answer trigger, and the same after one."""
    from eagle3.tiny.corpus import iter_documents

    text = "\n\n".join(iter_documents(seed=7, count=n_docs))
    ids = hf_tok(text, add_special_tokens=False).input_ids
    trigger = hf_tok.convert_tokens_to_ids(spec.answer_triggers[0])
    return ids, [trigger, *ids]
