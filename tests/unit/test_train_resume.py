"""FSDP checkpoints: a killed 2-process FSDP run resumes to the uninterrupted loss curve, and a
checkpoint whose optimizer state another strategy wrote is refused naming both."""

import time
from pathlib import Path

import pytest
import torch

from test_train import kill_torchrun, lines, make_train_run, torchrun, weights

FSDP = ['train.strategy="fsdp"']


def accumulating(config, grad_accum: int):
    return config.model_copy(update={"train": config.train.model_copy(update={"grad_accum": grad_accum})})


def test_a_killed_two_process_fsdp_run_resumes_to_the_uninterrupted_loss_curve(tmp_path):
    whole, names = make_train_run(tmp_path / "whole", *FSDP)
    torchrun(whole, names, nproc=2)
    reference = lines(Path(whole.run_dir) / "train" / "log.jsonl")

    killed, _ = make_train_run(tmp_path / "killed", *FSDP)
    run = Path(killed.run_dir)
    log, latest = run / "train" / "log.jsonl", run / "checkpoints" / "latest.json"
    proc = torchrun(killed, names, nproc=2, background=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (latest.exists() and log.exists() and len(lines(log)) >= 5):
        time.sleep(0.05)
    kill_torchrun(proc)  # both ranks, mid-run, after at least one checkpoint
    assert latest.exists() and len(lines(log)) < len(reference), "the kill came after a checkpoint, before the end"
    torchrun(killed, names, nproc=2)
    resumed = lines(log)
    assert [x["step"] for x in resumed] == [x["step"] for x in reference], "no step lost, none duplicated"
    for x, y in zip(reference, resumed):
        assert abs(x["loss"] - y["loss"]) < 1e-5 * max(1, x["loss"]), (x, y)
    wa, wb = weights(Path(whole.run_dir)), weights(run)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_an_fsdp_checkpoint_is_refused_by_a_run_of_another_strategy_naming_both(tmp_path):
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    config, names = make_train_run(tmp_path, *FSDP, "train.epochs=1")
    torchrun(config, names, nproc=2)
    same_batch = accumulating(config, 2)  # 1 process x 2, as 2 x 1 wrote it: only the strategy differs
    trainer = Trainer(same_batch, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
    with pytest.raises(ValueError, match=r"written by fsdp on 2 process\(es\), this run is fsdp on 1 process\(es\)"):
        trainer.train()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"grad_accum": 3},
            r"written at a global batch of 2 micro-batches of train.batch_tokens=120 per optimizer step \(1 "
            r"process\(es\) x train.grad_accum=2\), this run takes 3 of train.batch_tokens=120 \(1 process\(es\) x "
            r"train.grad_accum=3\)",
        ),
        (
            {"batch_tokens": 60},
            r"2 micro-batches of train.batch_tokens=120 .*, this run takes 2 of train.batch_tokens=60",
        ),
    ],
    ids=["grad_accum", "batch_tokens"],
)
def test_a_checkpoint_of_another_global_batch_is_refused_naming_both(tmp_path, change, message):
    """Processes and grad_accum may trade on resume (the FSDP test below); another number of
    micro-batches per step, or micro-batches of another size, would renumber the steps: refused."""
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    config, names = make_train_run(tmp_path, "train.grad_accum=2")
    target = resolve_model("tiny:qwen3")
    Trainer(config, names, target, [1, 2, 3], Dist(), log=lambda m: None).save()  # a step-0 checkpoint
    changed = config.model_copy(update={"train": config.train.model_copy(update=change)})
    with pytest.raises(ValueError, match=message):
        Trainer(changed, names, target, [1, 2, 3], Dist(), log=lambda m: None).train()
