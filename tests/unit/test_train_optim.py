"""train.optimizer: Muon on the drafter's weight matrices, AdamW on the rest, in one optimizer the trainer's
schedule, checkpoint and resume use as they use AdamW."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from eagle3.config import ConfigError, PipelineConfig, load_config
from eagle3.train.optim import MuonAdamW, build, orthogonalise
from test_train import lines
from test_train_levers import _trainer


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (24, 24)])
def test_newton_schulz_moves_every_singular_value_near_one(shape):
    torch.manual_seed(0)
    rank = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], rank))
    v, _ = torch.linalg.qr(torch.randn(shape[1], rank))
    grad = u @ torch.diag(torch.logspace(-1, 1, rank)) @ v.T  # singular values over two decades
    values = torch.linalg.svdvals(orthogonalise(grad))
    assert values.min() > 0.5 and values.max() < 1.3, values  # the quintic's band, not exactly 1


def _fake_grads(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen)


def test_muon_takes_the_weight_matrices_and_adamw_the_head_and_norms(tmp_path):
    trainer = _trainer(tmp_path, 'train.optimizer="muon"')
    model, opt = trainer.model, trainer.optimizer
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert {"fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"} <= muon
    assert "lm_head.weight" in adamw and "norm.weight" in adamw and not any(n.startswith("embed") for n in muon | adamw)
    assert muon | adamw == {n for n, p in model.named_parameters() if p.requires_grad}

    lr = 1e-3
    for group in opt.param_groups:
        group["lr"] = lr
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _fake_grads(model)
    _fake_grads(reference)
    opt.step()
    adamw_ref = torch.optim.AdamW(
        [p for n, p in reference.named_parameters() if n in adamw], lr=lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    adamw_ref.step()
    after = dict(model.named_parameters())
    for n, p in reference.named_parameters():
        if n in adamw:  # what torch's AdamW does with the same gradients
            assert torch.allclose(after[n], p, rtol=0, atol=1e-7), n
    for n in muon:  # an orthogonalised step of AdamW's RMS: every direction moves about equally
        shape = after[n].shape
        step = (before[n] - after[n]) / (lr * 0.2 * max(shape) ** 0.5)
        values = torch.linalg.svdvals(step.detach())
        # a random square gradient can have one near-zero singular value, which 5 steps do not lift
        assert torch.quantile(values, 0.05) > 0.5 and values.max() < 1.3, (n, values)


def test_a_muon_state_saved_and_loaded_continues_as_if_never_stopped(tmp_path):
    trainer = _trainer(tmp_path, 'train.optimizer="muon"')
    model, opt = trainer.model, trainer.optimizer
    for seed in (1, 2):
        _fake_grads(model, seed)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _fake_grads(model, 3)
    opt.step()  # the run that never stopped

    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved_model)
    opt2 = build(resumed, [p for p in resumed.parameters() if p.requires_grad], trainer.tc)
    opt2.load_state_dict(saved_opt)
    _fake_grads(resumed, 3)
    opt2.step()
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_adamw_stays_torchs_and_muon_with_fsdp_is_refused_naming_both():
    assert PipelineConfig().train.optimizer == "adamw"
    with pytest.raises(ConfigError, match=r"train.optimizer='muon'.*train.strategy='fsdp'"):
        load_config(None, ['train.optimizer="muon"', 'train.strategy="fsdp"'])


def test_a_muon_run_trains_and_its_checkpoint_resumes_with_the_muon_state(tmp_path):
    from eagle3.train.trainer import Dist, Trainer

    first = _trainer(tmp_path, 'train.optimizer="muon"')
    first.train()
    losses = [x["loss"] for x in lines(Path(first.config.run_dir) / "train" / "log.jsonl")]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    again = Trainer(first.config, first.data.shards, first.model_path, [1, 2, 3], Dist(), log=lambda m: None)
    again._resume()
    assert again.step == first.step
    saved, loaded = first.optimizer.state_dict(), again.optimizer.state_dict()
    assert [g["muon"] for g in loaded["param_groups"]] == [True, False]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)
