"""The speculators layout loaded by vllm-project/speculators itself (``SpeculatorModel.from_pretrained``).

Optional and outside CI: speculators lives in its own venv (``make test-speculators`` builds
.venv-speculators and runs this file); without that venv every test here skips. The export is
written here, in the pipeline venv; tests/speculators_loader.py loads it in the speculators venv
and writes back what the library loaded, which is checked here: every stored tensor bit-exact,
d2t/t2d as stored, embed_tokens the target's embedding (not zeros), and the lm_head speculators
derives from the verifier through t2d equal to ours, derived through d2t.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.speculators]
SPEC_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"
LOADER = ROOT / "tests" / "speculators_loader.py"
V = 4096


@pytest.fixture(scope="module", autouse=True)
def needs_speculators():
    if not (ROOT / ".venv-speculators" / ".eagle3-stamp").exists():
        pytest.skip("no .venv-speculators: `make test-speculators` builds it (optional, kept out of CI)")


def _load_with_speculators(folder: Path, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(out)}
    done = subprocess.run(
        [str(SPEC_PYTHON), str(LOADER), str(folder), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=out.parent,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return load_file(str(out / "loaded.safetensors")), json.loads((out / "loaded.json").read_text())


def _target(target: Path, name: str) -> torch.Tensor:
    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        return fh.get_tensor(name)


@pytest.mark.parametrize(
    "arch, draft_ids", [("qwen3", range(0, V, 4)), ("llama", None)], ids=["qwen3-draft-1024", "llama-identity"]
)
def test_speculators_loads_the_export_exactly(tmp_path, arch, draft_ids):
    from eagle3.export.layouts import export_checkpoint, validate_export, write_untrained_checkpoint
    from eagle3.tiny import ensure_tiny

    target = ensure_tiny(arch)
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt", draft_ids=draft_ids, aux_layer_ids=[1, 2, 3], seed=3)
    folder = export_checkpoint(ckpt, target, tmp_path / "export", ["speculators"])["speculators"]
    assert validate_export(folder, "speculators", target) == []
    stored = load_file(str(folder / "model.safetensors"))

    loaded, info = _load_with_speculators(folder, tmp_path / "loaded")

    print(
        f"\nspeculators {info['speculators']}, transformers {info['transformers']}, torch {info['torch']}: "
        f"{info['class']}"
    )
    assert info["class"] == "Eagle3DraftModel"
    for name, tensor in stored.items():
        if name in ("d2t", "t2d") and draft_ids is None:
            continue  # an identity vocabulary: speculators keeps no maps (checked below)
        assert name in loaded, f"speculators did not load {name}"
        if tensor.is_floating_point():  # loaded in whatever float dtype: the values must be the stored bf16 ones
            assert torch.equal(loaded[name].float(), tensor.float()), f"{name} changed on loading"
        else:
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), (
                f"{name} changed on loading"
            )

    embed = _target(target, "model.embed_tokens.weight").to(torch.bfloat16)
    assert torch.equal(loaded["embed_tokens.weight"].to(torch.bfloat16), embed), "embed_tokens is not the target's"
    assert loaded["embed_tokens.weight"].abs().sum() > 0
    assert not info["embed_requires_grad"]

    if draft_ids is None:
        assert not info["use_draft_vocab"] and "d2t" not in loaded and "t2d" not in loaded
    else:
        ids = torch.tensor(list(draft_ids))
        assert info["use_draft_vocab"]
        assert torch.equal(torch.arange(len(ids)) + loaded["d2t"], ids), (
            "draft id + d2t[draft id] != the chosen target id"
        )
        assert torch.equal(loaded["t2d"].nonzero().flatten(), ids), "t2d is not true exactly at the chosen target ids"
    # speculators takes the verifier's lm_head rows where t2d is true; the untrained export holds the
    # target's rows at draft id + d2t. Equal only when both maps name the same ids in the same order.
    assert torch.equal(
        loaded["verifier_lm_head.weight"].to(torch.bfloat16), loaded["lm_head.weight"].to(torch.bfloat16)
    )

    ours = json.loads((folder / "config.json").read_text())
    assert {"speculators_version", "norm_before_fc", "embed_requires_grad"} <= set(info["config_fields"])
    missing = [f for f in info["config_fields"] if f not in ours]
    assert not missing, f"speculators' Eagle3SpeculatorConfig has fields our export does not write: {missing}"
    got = info["config"]
    assert got["draft_vocab_size"] == len(stored["lm_head.weight"]) and got["eagle_aux_hidden_state_layer_ids"] == [
        1,
        2,
        3,
    ]
    assert (got["norm_before_fc"], got["fc_norm"], got["norm_output"], got["norm_before_residual"]) == (
        False,
        False,
        False,
        False,
    )
    assert got["transformer_layer_config"]["vocab_size"] == V and got["transformer_layer_config"]["model_type"] == arch
