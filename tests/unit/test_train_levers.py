"""The sample-efficiency knobs of [train]: hidden-state noise, a frozen lm_head, a warm start from a target
layer. Off, each keeps the config hash (so a run on disk stays current); on, each changes it and does what
its description says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3.config import PipelineConfig, section_hash
from test_train import lines, make_train_run

KNOBS_ON = {
    "hidden_noise": 0.05,
    "hidden_noise_kind": "uniform",
    "freeze_lm_head": True,
    "warm_start": "target_layer",
    "warm_start_layer": 2,
    "optimizer": "muon",
}


def test_knobs_at_their_defaults_keep_the_train_hash_and_each_one_on_changes_it():
    base = PipelineConfig()
    # the hash the default [train] section had before these knobs existed (main at e486ade)
    assert section_hash(base.train) == "affa8c557a78078c"
    explicit = PipelineConfig.model_validate({"train": {k: v for k, v in type(base.train).LATER_KEYS.items()}})
    assert section_hash(explicit.train) == section_hash(base.train)
    for key, value in KNOBS_ON.items():
        changed = PipelineConfig.model_validate({"train": {key: value}})
        assert section_hash(changed.train) != section_hash(base.train), key


def _trainer(tmp_path, *sets):
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    config, names = make_train_run(tmp_path, "train.epochs=1", *sets)
    return Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)


def test_warm_start_copies_the_target_layer_where_the_knob_says(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.target import load_target_head, load_target_layer

    trainer = _trainer(tmp_path, 'train.warm_start="target_layer"')
    model, folder = trainer.model, resolve_model("tiny:qwen3")
    layer = load_target_layer(folder, 3, qk_norms=True)  # default: the layer the top tapped state (id 3) feeds
    H = model.config.hidden_size
    attn, mid = model.midlayer.self_attn, model.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, name).weight[:, H:], layer[f"self_attn.{name}.weight"].float()), name
    assert torch.equal(attn.o_proj.weight, layer["self_attn.o_proj.weight"].float())
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(mid.mlp, name).weight, layer[f"mlp.{name}.weight"].float()), name
    assert torch.equal(mid.hidden_norm.weight, layer["input_layernorm.weight"].float())
    assert torch.equal(mid.post_attention_layernorm.weight, layer["post_attention_layernorm.weight"].float())
    assert torch.equal(attn.q_norm.weight, layer["self_attn.q_norm.weight"].float())
    assert torch.equal(model.norm.weight, load_target_head(folder).norm_weight.float())
    fc = model.fc.weight
    assert torch.equal(fc[:, 2 * H :], torch.eye(H)) and not fc[:, : 2 * H].any()
    # the embedding half keeps its random start
    assert attn.q_proj.weight[:, :H].abs().sum() > 0


def test_warm_start_layer_picks_another_layer_and_a_missing_one_is_named(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.target import TargetWeightsError, load_target_layer

    trainer = _trainer(tmp_path / "a", 'train.warm_start="target_layer"', "train.warm_start_layer=1")
    layer = load_target_layer(resolve_model("tiny:qwen3"), 1, qk_norms=True)
    assert torch.equal(trainer.model.midlayer.self_attn.o_proj.weight, layer["self_attn.o_proj.weight"].float())
    with pytest.raises(TargetWeightsError, match="decoder layer 99"):
        _trainer(tmp_path / "b", 'train.warm_start="target_layer"', "train.warm_start_layer=99")


def test_a_frozen_lm_head_stays_at_the_targets_rows(tmp_path):
    trainer = _trainer(tmp_path, "train.freeze_lm_head=true")
    before = trainer.model.lm_head.weight.detach().clone()
    other = trainer.model.fc.weight.detach().clone()
    trainer.train()
    assert torch.equal(trainer.model.lm_head.weight, before)
    assert not torch.equal(trainer.model.fc.weight, other), "the rest trains"


@pytest.mark.parametrize("kind", ["gaussian", "uniform"])
def test_noise_changes_training_is_reproducible_and_never_touches_evaluation(tmp_path, kind):
    plain = _trainer(tmp_path / "plain")
    noisy = _trainer(tmp_path / "noisy", "train.hidden_noise=0.2", f'train.hidden_noise_kind="{kind}"')
    again = _trainer(tmp_path / "again", "train.hidden_noise=0.2", f'train.hidden_noise_kind="{kind}"')
    # evaluation reads the states as stored: equal before training
    assert plain.evaluate()["loss_per_step"] == noisy.evaluate()["loss_per_step"]
    for t in (plain, noisy, again):
        t.train()
    loss = {n: [x["loss"] for x in lines(Path(t.config.run_dir) / "train" / "log.jsonl")] for n, t in
            (("plain", plain), ("noisy", noisy), ("again", again))}  # fmt: skip
    assert loss["noisy"] != loss["plain"]
    assert loss["noisy"] == loss["again"], "the noise is a function of seed, step and batch"


def test_noise_scales_with_each_tokens_rms_and_spares_padding(tmp_path):
    trainer = _trainer(tmp_path, "train.hidden_noise=0.1", 'train.hidden_noise_kind="uniform"')
    aux = torch.ones(1, 4, 6) * torch.tensor([1.0, 10.0, 100.0, 5.0])[None, :, None]
    valid = torch.tensor([[True, True, True, False]])
    from eagle3.train.levers import noisy

    out = noisy(aux, valid, trainer.tc, 0, ["x"])
    delta = (out - aux).abs()
    rms = torch.tensor([1.0, 10.0, 100.0])
    assert (delta[0, :3].amax(-1) <= 0.1 * rms + 1e-6).all() and (delta[0, :3].amax(-1) > 0.01 * rms).all()
    assert not delta[0, 3].any(), "padding is left alone"
    assert json.dumps(trainer.tc.model_dump())  # the knobs serialise for the worker's request
