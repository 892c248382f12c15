"""Run directories and target heads for the training benchmark, at the tiny target's shapes or a
real target's (random weights: the benchmark measures speed, not what is learnt).

- ``tiny``: the tiny Qwen3 target's real extracted states (H 128, vocab 4,096, draft vocab 4,096).
- ``smollm2_8k`` / ``smollm2_32k``: SmolLM2-135M-Instruct's shapes (Llama, H 576, 9 heads / 3 KV
  heads of 64, MLP 1,536, vocab 49,152, tied embeddings; its config.json below) with a draft
  vocabulary of 8,192 or 32,768 ids. The target folder holds only config.json and a random bf16
  embedding + final norm (what training reads); the stored states are random bf16 written through
  the extract stage's own writer, index and marker (the HF forward swapped for a random fill).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

SMOLLM2 = {  # models/smollm2-135m/config.json (HuggingFaceTB/SmolLM2-135M-Instruct), the keys training reads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 30,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

CONFIGS = {  # name -> (target, draft vocab, batch_tokens)
    "tiny": ("tiny", 4096, 2048),
    "smollm2_8k": ("smollm2", 8192, 1024),
    "smollm2_32k": ("smollm2", 32768, 1024),
}


def smollm2_target(folder: Path, draft_ids: np.ndarray) -> Path:
    """A SmolLM2-135M-shaped target folder with random weights (embedding std 0.04, as trained ones).
    The rows outside the draft vocabulary are scaled down so that the target's top-1 lies in the
    draft vocabulary almost always, as it does for a draft vocabulary of the most frequent tokens."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMOLLM2, indent=2))
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(SMOLLM2["vocab_size"], SMOLLM2["hidden_size"], generator=g) * 0.02
    embed[torch.from_numpy(draft_ids)] *= 2
    embed = embed.bfloat16()
    norm = (1 + 0.1 * torch.randn(SMOLLM2["hidden_size"], generator=g)).bfloat16()
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, str(folder / "model.safetensors"))
    return folder


def _random_fill(hidden: int):
    def fill(config, seqs, the_plan, writer, replica, log, shard, progress=None):
        g = torch.Generator().manual_seed(len(seqs))
        for k, s in enumerate(seqs):
            n = len(s)
            writer.write(
                k,
                torch.randn(n, 3 * hidden, generator=g).bfloat16(),
                (torch.randn(n, hidden, generator=g) * 2).bfloat16(),
            )

    return fill


def make_run(work: Path, name: str, samples: int, ttt: int, *sets: str):
    """(config, shard names, target folder, layer ids) for one benchmark configuration."""
    from safetensors.numpy import save_file

    import eagle3.extract.stage as extract
    from eagle3.models import resolve_model
    from eagle3.run_facts import RunFacts
    from extract_runs import make_run as tokenized_run

    target, draft, batch_tokens = CONFIGS[name]
    rng = np.random.default_rng(0)
    lengths = tuple(int(x) for x in rng.integers(100, 400, samples))
    config, names = tokenized_run(
        work,
        (lengths[: samples // 2], lengths[samples // 2 :]),
        f"train.batch_tokens={batch_tokens}",
        f"train.ttt_steps={ttt}",
        "train.eval_fraction=0.05",
        "train.save_every_steps=100000",
        "train.eval_every_steps=100000",
        *sets,
    )
    the_plan = extract.plan(RunFacts.resolve(config), names)
    if target == "tiny":
        folder, vocab = resolve_model("tiny:qwen3"), 4096
        d2t, t2d = np.zeros(draft, dtype=np.int64), np.ones(vocab, dtype=bool)
    else:
        vocab, hidden = SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]
        # a draft vocabulary of `draft` target ids spread over the whole vocabulary
        ids = np.sort(np.random.default_rng(1).choice(vocab, draft, replace=False))
        folder = str(smollm2_target(work / "smollm2-shaped", ids))
        the_plan = dataclasses.replace(the_plan, hidden_size=hidden)
        real_fill, extract._fill_with_hf = extract._fill_with_hf, _random_fill(hidden)
        d2t = ids - np.arange(draft)
        t2d = np.zeros(vocab, dtype=bool)
        t2d[ids] = True
    try:
        extract.record(config, [extract.extract_shard(config, s, the_plan) for s in names], the_plan)
    finally:
        if target != "tiny":
            extract._fill_with_hf = real_fill
    vocab_dir = Path(config.run_dir) / "vocab"
    vocab_dir.mkdir(exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(vocab_dir / "draft_vocab.safetensors"))
    return config, names, folder, [1, 2, 3]
