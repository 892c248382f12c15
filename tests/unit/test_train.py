"""The drafter and its training: TTT attention against step-by-step serving, the loss against a
direct computation, DDP against one process, resume against an uninterrupted run (by killing it)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.run_facts import RunFacts
from eagle3.train.loss import target_view, ttt_loss

SMALL = DrafterConfig(
    arch="qwen3",
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    vocab_size=50,
    draft_vocab_size=50,
    target_hidden_size=32,
    aux_layer_ids=[1, 2, 3],
)


def small_model(arch="qwen3", seed=0, **flags) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(DrafterConfig(**{**SMALL.__dict__, "arch": arch, **flags}))
    with torch.no_grad():  # random norms too, so a misplaced norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def serve_reference(
    model: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, t: int, steps: int
) -> list[torch.Tensor]:
    """What a serving engine computes when drafting ``steps`` tokens after position t: a cache
    of step-0 entries for positions 0..t, then one new entry per drafted token at positions t+1,
    t+2, ..., each attending to everything in the cache so far. Plain loops, no masks."""
    layer, attn, c = model.midlayer, model.midlayer.self_attn, model.config
    keys, values = [], []
    prefix = aux[: t + 1]
    hidden = model.fc(model.input_norm(prefix) if c.norm_before_fc else prefix)  # EAGLE-3.1's input_norm
    x, residual = layer.attn_input(model.embed_tokens(ids[1 : t + 2]), hidden)
    q, k, v = attn.qkv(x[None], torch.arange(t + 1))
    outs = []
    for s in range(t + 1):  # the prefix (step 0 at every position up to t)
        keys.append(k[0, :, s]), values.append(v[0, :, s])

    def attend(query):
        K, V = torch.stack(keys, 1), torch.stack(values, 1)  # [h, n, d]
        w = torch.softmax((query[:, None, :] * K).sum(-1) / c.head_dim**0.5, dim=-1)
        return (w[..., None] * V).sum(1)

    o = attn.o_proj(attend(q[0, :, t]).reshape(-1))
    h = layer.after_attention(o, residual[t])
    outs.append(model.lm_head(model.norm(h)))
    h = model.norm(h) if c.norm_output else h  # EAGLE-3.1: the next step reads the post-norm state
    for step in range(1, steps):
        x, residual = layer.attn_input(model.embed_tokens(ids[t + 1 + step : t + 2 + step]), h[None])
        q, k, v = attn.qkv(x[None], torch.tensor([t + step]))
        keys.append(k[0, :, 0]), values.append(v[0, :, 0])
        o = attn.o_proj(attend(q[0, :, 0]).reshape(-1))
        h = layer.after_attention(o, residual[0])
        outs.append(model.lm_head(model.norm(h)))
        h = model.norm(h) if c.norm_output else h
    return outs


@pytest.mark.parametrize(
    "arch, flags",
    [
        ("qwen3", {}),
        ("llama", {}),
        ("llama", {"norm_before_fc": True}),
        ("qwen3", {"norm_output": True}),
        ("llama", {"norm_before_fc": True, "norm_output": True}),
    ],
)
def test_ttt_steps_equal_step_by_step_drafting(arch, flags):
    model = small_model(arch, **flags)
    T, K = 12, 4
    ids = torch.randint(0, 50, (2, T))
    aux = torch.randn(2, T, 3 * 32)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 9:] = False  # the second row is padded after 9 tokens
    with torch.no_grad():
        logits = model.ttt_logits(ids, aux, valid, K)
        assert len(logits) == K and all(x.shape == (2, T, 50) for x in logits)
        for b, t in ((0, 0), (0, 5), (0, 7), (1, 3), (1, 4)):  # t + K + 1 stays inside row b's real tokens
            ref = serve_reference(model, ids[b], aux[b], t, K)
            for k in range(K):
                torch.testing.assert_close(
                    logits[k][b, t], ref[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"step {k} position {t}: {m}"
                )


def test_ttt_never_reads_the_future():
    model = small_model()
    T, K = 10, 3
    ids, aux, valid = torch.randint(0, 50, (1, T)), torch.randn(1, T, 96), torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        base = model.ttt_logits(ids, aux, valid, K)
        aux2 = aux.clone()
        aux2[0, 6] += 1.0
        moved = model.ttt_logits(ids, aux2, valid, K)
    for k in range(K):
        assert torch.equal(base[k][0, :6], moved[k][0, :6]), "positions before 6 must not see aux[6]"
        assert not torch.allclose(base[k][0, 6], moved[k][0, 6])


def test_loss_equals_a_direct_computation():
    model = small_model()
    T, K, D = 9, 3, 50
    ids, aux = torch.randint(0, 50, (2, T)), torch.randn(2, T, 96)
    valid = torch.ones(2, T, dtype=torch.bool)
    mask = torch.zeros(2, T, dtype=torch.long)
    mask[:, 4:] = 1
    target_logits = torch.randn(2, T, 50) * 3
    t2d = torch.ones(50, dtype=torch.bool)
    t2d[target_logits[0, 5].argmax()] = False  # one position's target top-1 outside the draft vocab
    d2t = torch.zeros(D, dtype=torch.long)
    with torch.no_grad():
        logits = model.ttt_logits(ids, aux, valid, K)
    counts = [int(mask[:, 2 + k :].sum()) for k in range(K)]
    loss, stats = ttt_loss(logits, target_view(target_logits, d2t, t2d), mask, d2t, 0.8, counts)
    expected = 0.0
    for k in range(K):
        total = 0.0
        for b in range(2):
            for t in range(T):
                src = t + 1 + k  # the target position whose distribution step k at t learns
                if t + 2 + k >= T or mask[b, t + 2 + k] == 0 or not t2d[target_logits[b, src].argmax()]:
                    continue
                p = torch.softmax(target_logits[b, src], -1)
                total += float(-(p * F.log_softmax(logits[k][b, t], -1)).sum())
        expected += 0.8**k * total / counts[k]
    assert abs(float(loss) - expected) < 1e-4 * max(1.0, expected)
    assert stats["positions"][0] == counts[0] and stats["counted"][0] < stats["positions"][0] + 1


# --- training runs on a small run directory ----------------------------------------------------


def make_train_run(tmp_path: Path, *sets: str, identity_vocab: bool = True):
    """A run dir with extracted states; the identity draft vocabulary unless ``identity_vocab=False``
    (then the caller runs the vocab stage on the token counts written here)."""
    from safetensors.numpy import save_file

    from eagle3.extract.stage import extract_shard, plan, record
    from extract_runs import make_run

    lengths = tuple(range(20, 60, 3))  # 14 samples per shard
    config, names = make_run(
        tmp_path,
        (lengths, lengths[::-1]),
        "train.batch_tokens=120",
        "train.ttt_steps=3",
        "train.eval_fraction=0.15",
        "train.epochs=2",
        "train.learning_rate=3e-3",
        "train.save_every_steps=2",
        *sets,
    )
    the_plan = plan(RunFacts.resolve(config), names)
    record(config, [extract_shard(config, s, the_plan) for s in names], the_plan)
    run = Path(config.run_dir)
    if not identity_vocab:
        import pyarrow.parquet as pq

        for name in names:  # supervised-token counts per shard, as the tokenize stage writes them
            table = pq.read_table(run / "tokenized" / name).to_pydict()
            ids = np.concatenate(
                [np.asarray(x)[np.asarray(m, dtype=bool)] for x, m in zip(table["input_ids"], table["loss_mask"])]
            )
            save_file(
                {"counts": np.bincount(ids, minlength=4096).astype(np.int64)},
                str(run / "tokenized" / f"{Path(name).stem}.counts.safetensors"),
            )
        return config, names
    (run / "vocab").mkdir()
    save_file(
        {"d2t": np.zeros(4096, dtype=np.int64), "t2d": np.ones(4096, dtype=bool)},
        str(run / "vocab" / "draft_vocab.safetensors"),
    )
    return config, names


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def torchrun(config, names, nproc: int, env_extra=None, background=False):
    """The train stage's torchrun command on ``nproc`` processes. Its rendezvous is the product's default
    (--standalone: a port the OS hands out), never a port the test picks: a picked one collided with
    another xdist worker's or server's. In the background its output goes to ``output_of(proc)``."""
    from eagle3.durable import atomic_write_json
    from eagle3.models import resolve_model
    from eagle3.train.stage import torchrun_argv

    run = Path(config.run_dir)
    request = run / "train" / "request.json"
    atomic_write_json(
        request,
        {
            "config": json.loads(config.model_dump_json()),
            "shards": names,
            "model_path": resolve_model(config.server.model),
            "layer_ids": [1, 2, 3],
            "result_path": str(run / "train" / "result.json"),
        },
    )
    patched = config.model_copy(update={"train": config.train.model_copy(update={"nproc_per_node": nproc})})
    argv = torchrun_argv(patched, request)
    assert "--standalone" in argv, argv
    argv[0] = sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    if background:
        out = run.parent / f"torchrun-{nproc}-{time.monotonic_ns()}.out"
        with out.open("wb") as sink:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc.output_path = out
        return proc
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def output_of(proc, tail: int = 3000) -> str:
    """The last ``tail`` characters a background torchrun printed (for an assertion's message)."""
    return proc.output_path.read_text(errors="replace")[-tail:]


def kill_torchrun(proc) -> None:
    """SIGKILL a background ``torchrun`` and every worker at once, as a crash would take them. torchrun
    starts each worker in a session of its own, so a killpg of torchrun's group leaves the workers
    running: they trained the run to its end beside the "resumed" one."""
    from eagle3.guard import tree

    for pid in tree(proc.pid):  # torchrun's group and all its descendants, found before any dies
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    return load_file(str(Path(latest["path"]) / "model.safetensors"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_process_at_the_same_global_batch(tmp_path, strategy):
    one, names = make_train_run(tmp_path / "one", "train.grad_accum=2")
    two, _ = make_train_run(tmp_path / "two", "train.grad_accum=1", f'train.strategy="{strategy}"')
    torchrun(one, names, nproc=1)
    out = torchrun(two, names, nproc=2)
    assert "[rank 1]" in out.stdout, "two processes ran"
    a, b = lines(Path(one.run_dir) / "train" / "log.jsonl"), lines(Path(two.run_dir) / "train" / "log.jsonl")
    assert [x["step"] for x in a] == [x["step"] for x in b] and len(a) >= 4
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) < 1e-4 * max(1, x["loss"]) and x["tokens"] == y["tokens"]
    wa, wb = weights(Path(one.run_dir)), weights(Path(two.run_dir))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_killed_run_resumes_to_the_uninterrupted_loss_curve(tmp_path):
    whole, names = make_train_run(tmp_path / "whole")
    torchrun(whole, names, nproc=1)
    reference = lines(Path(whole.run_dir) / "train" / "log.jsonl")

    killed, _ = make_train_run(tmp_path / "killed")
    log = Path(killed.run_dir) / "train" / "log.jsonl"
    proc = torchrun(killed, names, nproc=1, background=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 5):
        time.sleep(0.05)
    kill_torchrun(proc)  # mid-run, between checkpoints (every 2 steps)
    assert len(lines(log)) < len(reference), "the kill came before the end"
    torchrun(killed, names, nproc=1)
    resumed = lines(log)
    assert [x["step"] for x in resumed] == [x["step"] for x in reference], "no step lost, none duplicated"
    for x, y in zip(reference, resumed):
        assert abs(x["loss"] - y["loss"]) < 1e-6 * max(1, x["loss"]), (x, y)
    wa, wb = weights(Path(whole.run_dir)), weights(Path(killed.run_dir))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_training_beats_the_untrained_drafter_on_held_out_data_and_picks_the_best(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    config, names = make_train_run(tmp_path, "train.epochs=3")
    trainer = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
    before = trainer.evaluate()
    result = trainer.train()
    evals = lines(Path(config.run_dir) / "train" / "eval.jsonl")
    assert len(evals) == 3 and result["steps"] == trainer.total_steps
    assert evals[-1]["loss_per_step"][0] < before["loss_per_step"][0]
    best = json.loads((Path(config.run_dir) / "checkpoints" / "best.json").read_text())
    assert best["acceptance_length"] == max(e["acceptance_length"] for e in evals)
    assert Path(best["path"]).name == f"step-{best['step']:06d}" and (Path(best["path"]) / "model.safetensors").exists()


def test_max_steps_caps_the_run_and_its_schedule(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    config, names = make_train_run(tmp_path, "train.epochs=5", "train.max_steps=3", "train.eval_every_steps=0")
    trainer = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
    assert trainer.steps_per_epoch * 5 > 3 == trainer.total_steps
    result = trainer.train()
    log = lines(Path(config.run_dir) / "train" / "log.jsonl")
    assert result["steps"] == 3 and [x["step"] for x in log] == [1, 2, 3]
    from eagle3.train.trainer import lr_at

    # The schedule spans the 3 steps, not 5 epochs: the last step runs at the end of the cosine.
    assert [x["lr"] for x in log] == pytest.approx([lr_at(k, 3, config.train) for k in range(3)])
    assert len(lines(Path(config.run_dir) / "train" / "eval.jsonl")) == 1  # the capped run is evaluated at its end
    assert (Path(config.run_dir) / "checkpoints" / "best.json").exists()


def test_two_runs_on_one_machine_train_at_once(tmp_path):
    """The default rendezvous takes a free port: a second run on the same machine (a nightly
    schedule next to a manual run) trains, where a fixed port failed it with EADDRINUSE."""
    runs = [make_train_run(tmp_path / name) for name in ("a", "b")]
    procs = [torchrun(config, names, nproc=1, background=True) for config, names in runs]
    codes = [proc.wait(timeout=600) for proc in procs]
    assert codes == [0, 0], [output_of(proc) for proc in procs]
    for config, _ in runs:
        run = Path(config.run_dir)
        assert (
            json.loads((run / "train" / "result.json").read_text())["steps"]
            == len(lines(run / "train" / "log.jsonl"))
            > 0
        )


def test_torchrun_gets_the_multi_node_settings():
    from eagle3.config import DEMO_RECIPE, ConfigError, load_config
    from eagle3.train.stage import torchrun_argv

    one = torchrun_argv(load_config(DEMO_RECIPE, []), Path("/r/request.json"))
    assert (
        "--nproc-per-node=1" in one
        and "--nnodes=1" in one
        and "--standalone" in one
        and one[-3:] == ["-m", "eagle3.train.worker", "/r/request.json"]
    )
    assert not any(a.startswith(("--master-port", "--rdzv-endpoint")) for a in one), one
    fixed = torchrun_argv(load_config(DEMO_RECIPE, ['train.rdzv_endpoint="127.0.0.1:29555"']), Path("/r/request.json"))
    assert "--master-addr=127.0.0.1" in fixed and "--master-port=29555" in fixed and "--standalone" not in fixed
    with pytest.raises(ConfigError, match="rdzv_endpoint as host:port of node 0"):
        load_config(DEMO_RECIPE, ["train.nnodes=2"])
    with pytest.raises(ConfigError, match="node_rank=2 must be below train.nnodes=2"):
        load_config(DEMO_RECIPE, ["train.nnodes=2", "train.node_rank=2", 'train.rdzv_endpoint="node0:29400"'])
    either_order = load_config(
        DEMO_RECIPE, ['train.rdzv_endpoint="node0:29400"', "train.nnodes=2", "train.node_rank=1"]
    )
    assert either_order.train.nnodes == 2 and either_order.train.node_rank == 1
    many = torchrun_argv(
        load_config(
            DEMO_RECIPE,
            [
                "train.nnodes=4",
                "train.node_rank=2",
                "train.nproc_per_node=8",
                'train.rdzv_endpoint="node0:29400"',
                'train.rdzv_id="job7"',
            ],
        ),
        Path("/r/request.json"),
    )
    for flag in (
        "--nproc-per-node=8",
        "--nnodes=4",
        "--node-rank=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29400",
        "--rdzv-id=job7",
    ):
        assert flag in many, (flag, many)


def test_online_extraction_trains_like_stored_states(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    offline, names = make_train_run(tmp_path / "offline", "train.epochs=1")
    online = offline.model_copy(update={"extract": offline.extract.model_copy(update={"mode": "online"})})
    losses = {}
    for name, config in (("offline", offline), ("online", online)):
        for sub in ("checkpoints", "train"):
            shutil.rmtree(Path(config.run_dir) / sub, ignore_errors=True)
        trainer = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
        assert (trainer.extractor is None) == (name == "offline")
        trainer.save = lambda: None
        trainer.train()
        losses[name] = [x["loss"] for x in lines(Path(config.run_dir) / "train" / "log.jsonl")]
    assert len(losses["online"]) == len(losses["offline"]) >= 3
    for a, b in zip(losses["offline"], losses["online"]):
        assert abs(a - b) < 1e-3 * max(1.0, a), (losses["offline"], losses["online"])


def test_a_reduced_draft_vocabulary_from_the_counts_to_the_export(tmp_path):
    """1,024 of the tiny target's 4,096 ids: the vocab stage's choice is what training uses and what
    both exports carry -- draft id + d2t[draft id] is the chosen target id, t2d is true exactly
    there -- and the lm_head rows start as the target's rows of those ids and are then trained."""
    from safetensors.torch import load_file

    from eagle3.export.layouts import export_checkpoint, validate_export
    from eagle3.models import resolve_model
    from eagle3.tokenizer import load_tokenizer, tokenizer_path
    from eagle3.train.target import load_target_head
    from eagle3.train.trainer import Dist, Trainer
    from eagle3.vocab.mapping import load as load_vocab, must_keep
    from eagle3.vocab.stage import run_vocab

    D = 1024
    config, names = make_train_run(tmp_path, f"vocab.draft_vocab_size={D}", "train.epochs=1", identity_vocab=False)
    run, target = Path(config.run_dir), resolve_model("tiny:qwen3")
    entry = run_vocab(RunFacts.resolve(config), names)
    assert (entry["draft_vocab_size"], entry["target_vocab_size"], entry["identity"]) == (D, 4096, False)

    d2t, t2d = load_vocab(run / "vocab" / "draft_vocab.safetensors")
    chosen = np.arange(D) + d2t
    assert np.flatnonzero(t2d).tolist() == chosen.tolist(), "t2d is true exactly at the chosen ids"
    counts = sum(
        load_file(str(run / "tokenized" / f"{Path(n).stem}.counts.safetensors"))["counts"].numpy() for n in names
    )
    keep = must_keep(load_tokenizer(tokenizer_path(config)))
    free = sorted(set(chosen.tolist()) - set(keep))
    assert set(keep) <= set(chosen.tolist()) and counts[free].min() >= counts[~t2d].max(), (
        "kept ids plus the most frequent"
    )

    trainer = Trainer(config, names, target, [1, 2, 3], Dist(), log=lambda m: None)
    trainer.save()  # step 0: the drafter as initialised from the target
    trainer.train()
    head = load_target_head(target).lm_head
    ids = torch.from_numpy(chosen)
    initial = run / "checkpoints" / "step-000000"
    trained = Path(json.loads((run / "checkpoints" / "latest.json").read_text())["path"])
    assert trained != initial
    for ckpt in (initial, trained):
        for layout, folder in export_checkpoint(
            ckpt, target, tmp_path / "export" / ckpt.name, ["vllm", "speculators"]
        ).items():
            assert validate_export(folder, layout, target) == [], (ckpt.name, layout)
            t = load_file(str(folder / "model.safetensors"))
            assert torch.equal(torch.arange(D) + t["d2t"], ids), (ckpt.name, layout)
            assert torch.equal(t["t2d"].nonzero().flatten(), ids), (ckpt.name, layout)
            rows = t["lm_head.weight"]
            assert rows.shape == (D, 128)
            if ckpt == initial:
                assert torch.equal(rows, head[ids].to(torch.bfloat16)), layout
            else:  # trained away from the target's rows, each still nearest to its own target id's row
                assert not torch.equal(rows, head[ids].to(torch.bfloat16)), layout
                sim = F.normalize(rows.float(), dim=1) @ F.normalize(head.float(), dim=1).T
                assert torch.equal(sim.argmax(dim=1), ids), layout
