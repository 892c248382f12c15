"""The target on the real path: hub ids through a Hugging Face cache (offline), the config's vocab
size over the tokenizer's, and tied-embedding targets through training and export.

The hub cache is built here from the tiny model the way the hub lays one out (``models--ORG--NAME``
with ``refs/main`` naming a snapshot whose files are symlinks into ``blobs/``); nothing is
downloaded. Every stage under test reads the model through that cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import PYTHON, ROOT
from eagle3.config import load_config
from eagle3.models import ModelNotFoundError, resolve_model, served_name, template_hash
from eagle3.run_facts import RunFacts
from eagle3.tiny import build_tiny, ensure_tiny

SHA = "0123456789abcdef0123456789abcdef01234567"
PADDED_VOCAB = 4096 + 3 * 64  # config rows past the tokenizer's 4096 ids, as Qwen3 pads its embedding


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, sha: str = SHA) -> Path:
    """Lay ``folder`` out in ``cache`` as the hub does; the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snapshot


def padded_copy(src: Path, dest: Path, vocab_size: int = PADDED_VOCAB) -> Path:
    """The tiny target with a config that declares more embedding rows than the tokenizer has ids
    (the stages under test read the config, not the weights)."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny("qwen3")


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny) -> dict:
    root = tmp_path_factory.mktemp("hf")
    cache = root / "hub"
    padded = padded_copy(tiny, root / "padded")
    return {
        "cache": cache,
        "plain": add_to_hub_cache(cache, "acme/tiny-qwen3", tiny),
        "padded": add_to_hub_cache(cache, "acme/tiny-padded", padded),
    }


@pytest.fixture()
def offline_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def make_run(tmp_path: Path, *sets: str):
    """A run with one prompt shard and one finished generation shard of server token ids."""
    from eagle3.prepare.stage import run_prepare
    from eagle3.records import JsonlAppender
    from eagle3.tokenize.build import render_ids
    from eagle3.tokenizer import load_tokenizer, tokenizer_path

    src = tmp_path / "p.jsonl"
    src.write_text(
        "".join(json.dumps({"conversations": [{"from": "human", "value": f"question {i}?"}]}) + "\n" for i in range(4))
    )
    config = load_config(None, [f'run_dir="{tmp_path / "run"}"', f'data.source="{src}"', "data.num_shards=1", *sets])
    run_prepare(config)
    tok = load_tokenizer(tokenizer_path(config))
    gen = Path(config.run_dir) / "generations"
    gen.mkdir(parents=True)
    with JsonlAppender(gen / "shard-00000.jsonl") as out:
        for k, row in enumerate(pq.read_table(Path(config.run_dir) / "prompts" / "shard-00000.parquet").to_pylist()):
            answer = tok.encode(f"Thinking about {k}.\n</think>\n\nIt is {k}.", add_special_tokens=False) + [
                tok.convert_tokens_to_ids("<|im_end|>")
            ]
            out.append(
                {
                    "id": row["id"],
                    "prompt_token_ids": render_ids(tok, row["messages"], add_generation_prompt=True),
                    "completion_token_ids": answer,
                    "reasoning": "",
                    "content": "",
                    "finish_reason": "stop",
                }
            )
    (gen / "shard-00000.done.json").write_text("{}")
    return config, tok


def tokenize_and_vocab(config, tok):
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.vocab.stage import run_vocab

    facts = RunFacts.resolve(config)
    tokenize_shard(facts, "shard-00000.parquet", tok)
    return run_vocab(facts, ["shard-00000.parquet"])


def vocab_tensors(config) -> dict:
    return load_file(str(Path(config.run_dir) / "vocab" / "draft_vocab.safetensors"))


# -- 1. hub ids through the local cache ---------------------------------------------------------


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_cache):
    snapshot = str(offline_cache["plain"])
    assert resolve_model("acme/tiny-qwen3") == snapshot
    assert resolve_model(f"acme/tiny-qwen3@{SHA}") == snapshot  # a pinned commit
    assert resolve_model("acme/tiny-qwen3@main") == snapshot
    assert os.path.islink(Path(snapshot) / "config.json"), "read through the hub's symlinks, not a copy"
    # Requests and records name the hub id; a local folder keeps its path; an explicit name wins.
    assert served_name("acme/tiny-qwen3", snapshot) == "acme/tiny-qwen3"
    assert served_name(str(offline_cache["plain"]), snapshot) == snapshot
    assert served_name("acme/tiny-qwen3", snapshot, "target") == "target"


def test_a_hub_id_missing_from_the_cache_offline_names_the_id_and_the_fix(offline_cache):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("acme/absent")
    message = str(caught.value)
    assert "'acme/absent'" in message and "hf download acme/absent" in message
    assert str(offline_cache["cache"]) in message and "server.model" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelNotFoundError, match="--revision v2"):
        resolve_model("acme/tiny-qwen3@v2")  # the repo is cached, that revision is not


def test_a_cache_entry_without_config_json_is_not_a_model(offline_cache, tmp_path, monkeypatch):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer.json").write_text("{}")  # what `hf download ID tokenizer.json` leaves
    add_to_hub_cache(tmp_path / "hub", "acme/partial", partial)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="acme/partial"):
        resolve_model("acme/partial")


def test_neither_a_folder_nor_a_hub_id_is_a_clear_error(offline_cache, tmp_path):
    for spec in (str(tmp_path / "no" / "such" / "model"), "./models/x/y", "a/b/c"):
        with pytest.raises(ModelNotFoundError, match="no such local folder"):
            resolve_model(spec)


def test_the_cli_prints_one_line_for_a_missing_model(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "cli",
            "vocab",
            "--set",
            f'run_dir="{tmp_path / "run"}"',
            "--set",
            'server.model="acme/absent"',
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("eagle3 vocab: error: model 'acme/absent'")
        and "hf download acme/absent" in lines[0]
    )


def test_tokenize_vocab_and_generation_key_read_a_hub_id_through_the_cache(offline_cache, tmp_path):
    from eagle3.tokenizer import tokenizer_path

    config, tok = make_run(tmp_path, 'server.model="acme/tiny-qwen3"', "vocab.draft_vocab_size=256")
    assert tokenizer_path(config) == str(offline_cache["plain"])
    entry = tokenize_and_vocab(config, tok)
    assert entry["target_vocab_size"] == 4096 and entry["draft_vocab_size"] == 256
    # The records' model name is the id; the template hash is the snapshot's (the tiny template's).
    assert RunFacts.resolve(config).expected_target() == ("acme/tiny-qwen3", template_hash(str(ensure_tiny("qwen3"))))
    assert template_hash(str(offline_cache["plain"])) != ""


def test_extract_train_head_and_export_read_a_hub_id_through_the_cache(offline_cache, tiny, tmp_path):
    from eagle3.export.layouts import write_untrained_checkpoint
    from eagle3.export.stage import run_export
    from eagle3.extract.hf import model_fingerprint, num_layers_of
    from eagle3.train.target import load_target_head

    snapshot = resolve_model("acme/tiny-qwen3")
    assert num_layers_of(snapshot) == num_layers_of(str(tiny))
    assert model_fingerprint(snapshot) == model_fingerprint(str(tiny)), "the same weights, wherever the cache is"
    head, reference = load_target_head(snapshot), load_target_head(str(tiny))
    assert torch.equal(head.embed, reference.embed) and torch.equal(head.lm_head, reference.lm_head)

    config = load_config(None, [f'run_dir="{tmp_path / "run"}"', 'server.model="acme/tiny-qwen3"'])
    write_untrained_checkpoint(
        snapshot, tmp_path / "run" / "checkpoints" / "step-000001", draft_ids=list(range(0, 4096, 4))
    )
    entry = run_export(RunFacts.resolve(config))
    assert set(entry["paths"]) == {"vllm", "speculators"} and entry["problems"] == {} and entry["target"] == snapshot


# -- 2. the config's vocab size over the tokenizer's ---------------------------------------------


def test_the_vocab_follows_the_configs_rows_past_the_tokenizer(offline_cache, tmp_path):
    config, tok = make_run(tmp_path, 'server.model="acme/tiny-padded"', "vocab.draft_vocab_size=256")
    assert len(tok) < PADDED_VOCAB
    entry = tokenize_and_vocab(config, tok)
    counts = load_file(str(Path(config.run_dir) / "tokenized" / "shard-00000.counts.safetensors"))["counts"]
    vocab = vocab_tensors(config)
    assert len(counts) == PADDED_VOCAB and entry["target_vocab_size"] == PADDED_VOCAB
    assert vocab["t2d"].shape == (PADDED_VOCAB,) and vocab["d2t"].shape == (256,) and int(vocab["t2d"].sum()) == 256


def test_a_separate_tokenizer_folder_still_takes_the_targets_vocab_size(offline_cache, tmp_path):
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    for f in Path(offline_cache["padded"]).iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja" or f.name == "special_tokens_map.json":
            shutil.copy(f, tokenizer_only / f.name)
    assert not (tokenizer_only / "config.json").exists()
    config, tok = make_run(
        tmp_path,
        'server.model="acme/tiny-padded"',
        f'tokenize.tokenizer="{tokenizer_only}"',
        "vocab.draft_vocab_size=256",
    )
    assert tokenize_and_vocab(config, tok)["target_vocab_size"] == PADDED_VOCAB


# -- 3. tied-embedding targets ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tied") / "tiny-qwen3-tied", "qwen3", tie_embeddings=True)


def test_the_tied_build_stores_no_head_and_transformers_ties_it(tied, tiny):
    from transformers import AutoModelForCausalLM

    with safe_open(str(tied / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    with safe_open(str(tiny / "model.safetensors"), framework="pt") as fh:
        untied = set(fh.keys())
    assert untied - names == {"lm_head.weight"} and "lm_head.weight" in untied
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((tiny / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((tied / "eagle3_tiny.json").read_text())["tie_embeddings"] is True
    assert "tie_embeddings" not in json.loads((tiny / "eagle3_tiny.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(
        model.model.embed_tokens.weight, load_file(str(tiny / "model.safetensors"))["model.embed_tokens.weight"].float()
    )


def test_the_head_of_a_tied_target_is_its_embedding_and_gives_its_logits(tied):
    from transformers import AutoModelForCausalLM

    from eagle3.train.target import load_target_head

    head = load_target_head(str(tied))
    assert torch.equal(head.lm_head, head.embed)
    model = AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32).eval()
    seen = {}
    model.model.norm.register_forward_pre_hook(lambda module, args: seen.setdefault("last", args[0]))
    ids = torch.arange(5, 45)[None]
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(head.logits(seen["last"]), logits, rtol=1e-4, atol=1e-4)


def test_a_config_without_the_tie_key_takes_the_architectures_default(tied, tmp_path):
    from eagle3.train.target import TargetWeightsError, load_target_head, ties_embeddings

    keyless = tmp_path / "keyless"
    shutil.copytree(tied, keyless)
    config = json.loads((keyless / "config.json").read_text())
    del config["tie_word_embeddings"]
    (keyless / "config.json").write_text(json.dumps(config))
    # Qwen3 (and Llama) default to untied: no lm_head there is a broken model, said so by name.
    with pytest.raises(TargetWeightsError, match="lm_head.weight.*tie_word_embeddings"):
        load_target_head(str(keyless))
    for model_type, default in (("qwen3", False), ("llama", False), ("gemma", True)):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert ties_embeddings(folder, {"model_type": model_type}) is default, model_type
        assert ties_embeddings(folder, {"model_type": model_type, "tie_word_embeddings": not default}) is (not default)
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert ties_embeddings(tmp_path / "unknown", {"model_type": "no-such-architecture"}) is False


def test_a_tied_target_trains_and_exports(tied, tmp_path):
    from safetensors.numpy import save_file

    from eagle3.export.layouts import write_untrained_checkpoint
    from eagle3.export.stage import run_export
    from eagle3.extract.stage import extract_shard, plan, record
    from eagle3.train.trainer import Dist, Trainer
    from extract_runs import make_run as make_hidden_run

    lengths = tuple(range(20, 50, 5))
    config, names = make_hidden_run(
        tmp_path,
        (lengths,),
        f'server.model="{tied}"',
        "train.batch_tokens=120",
        "train.ttt_steps=2",
        "train.eval_fraction=0.2",
        "train.epochs=1",
        "train.learning_rate=3e-3",
        "train.save_every_steps=2",
    )
    the_plan = plan(RunFacts.resolve(config), names)
    record(config, [extract_shard(config, s, the_plan) for s in names], the_plan)
    ids = np.arange(0, 4096, 4, dtype=np.int64)  # a draft vocabulary a quarter of the target's
    t2d = np.zeros(4096, dtype=bool)
    t2d[ids] = True
    (Path(config.run_dir) / "vocab").mkdir()
    save_file(
        {"d2t": ids - np.arange(len(ids)), "t2d": t2d}, str(Path(config.run_dir) / "vocab" / "draft_vocab.safetensors")
    )

    trainer = Trainer(config, names, str(tied), [1, 2, 3], Dist(), log=lambda m: None)
    embed = trainer.target.embed
    assert torch.equal(trainer.model.lm_head.weight.detach().to(embed.dtype), embed[torch.from_numpy(ids)]), (
        "head rows start as the embedding's"
    )
    result = trainer.train()
    assert result["steps"] >= 2
    entry = run_export(RunFacts.resolve(config))
    assert set(entry["paths"]) == {"vllm", "speculators"} and entry["problems"] == {}

    twin = write_untrained_checkpoint(tied, tmp_path / "twin", draft_ids=ids.tolist())
    assert torch.equal(
        load_file(str(twin / "model.safetensors"))["lm_head.weight"].to(embed.dtype), embed[torch.from_numpy(ids)]
    )


@pytest.mark.anyio
async def test_the_managed_server_loads_the_snapshot_under_the_hub_id(offline_cache, tmp_path):
    """vLLM gets the resolved folder (no hub access at start-up, the bytes every stage reads) and
    --served-model-name ID; requests, records and tokenize's check all use the id."""
    from eagle3.serving.target import target_server
    from test_managed_server import STAND_IN  # a stand-in vLLM that answers /v1/models with the served name

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    config = load_config(
        None,
        [
            f'run_dir="{tmp_path / "run"}"',
            'server.model="acme/tiny-qwen3"',
            f'server.command=["{PYTHON}", "{script}"]',
            "server.args=[]",
            "server.startup_timeout_s=60",
        ],
    )
    (tmp_path / "run" / "generations").mkdir(parents=True)
    async with target_server(config, logging.getLogger("test")) as serving:
        argv = serving.server.argv
        assert argv[argv.index("--model") + 1] == str(offline_cache["plain"])
        assert argv[argv.index("--served-model-name") + 1] == "acme/tiny-qwen3"
        assert (serving.target.model, serving.target.template_hash) == RunFacts.resolve(config).expected_target()


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        ([], 1),  # off by default: the flag is added
        (["server.access_log=true"], 0),  # the knob keeps vLLM's access log
        (['server.args=["--disable-uvicorn-access-log"]'], 1),  # already there: not added twice
    ],
)
def test_the_access_log_is_off_by_default_and_on_with_the_knob(sets, expected):
    from eagle3.models import vllm_args

    config = load_config(None, ['server.reasoning_parser=""', *sets])
    args = vllm_args(config.server, "acme/any")
    assert args.count("--disable-uvicorn-access-log") == expected, args
