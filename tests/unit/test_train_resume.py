"""FSDP checkpoints: a killed 2-process FSDP run resumes to the uninterrupted loss curve, so does one
resumed on 4 processes and then on 3 at the same global batch, and a checkpoint whose optimizer state
another strategy wrote, or written at another global batch, is refused naming both."""

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from test_train import kill_torchrun, lines, make_train_run, output_of, torchrun, weights

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


def checkpoint_state(run: Path) -> dict:
    """trainer_state.json of the checkpoint latest.json names ({} before the first)."""
    latest = run / "checkpoints" / "latest.json"
    if not latest.exists():
        return {}
    return json.loads(
        (run / "checkpoints" / Path(json.loads(latest.read_text())["path"]).name / "trainer_state.json").read_text()
    )


def kill_after_a_checkpoint(config, names, nproc: int, past: int) -> dict:
    """torchrun on ``nproc`` processes, its whole group SIGKILLed once latest.json names a step after
    ``past``; the state of the checkpoint it left."""
    run = Path(config.run_dir)
    proc = torchrun(config, names, nproc=nproc, background=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and checkpoint_state(run).get("step", 0) <= past:
        time.sleep(0.02)
    assert proc.poll() is None, f"{nproc} processes: exited with {proc.returncode} before the kill:\n{output_of(proc)}"
    kill_torchrun(proc)  # every rank, mid-run, after a checkpoint
    return checkpoint_state(run)


def test_fsdp_resumes_from_two_to_four_and_from_four_to_three_processes_on_the_uninterrupted_curve(tmp_path):
    """One FSDP run at a global batch of 12 micro-batches, trained in three legs: 2 processes x grad_accum
    6, SIGKILLed after a checkpoint; resumed on 4 x 3 and SIGKILLed after a later one; resumed on 3 x 4
    to the end. Every step after each resume is on the uninterrupted run's curve, one process x 12 (one
    process and two train one curve at the same global batch: test_train.py), and no step is lost or
    repeated. Every other step is short, 6 micro-batches (3 + 3 + 0 + 0 on 4 processes, 4 + 2 + 0 on 3):
    processes without a micro-batch still join each pass."""
    from eagle3.models import resolve_model
    from eagle3.train.trainer import Dist, Trainer

    # 18 micro-batches an epoch: a step of 12, then one of 6; 3 epochs, a checkpoint after every step.
    config, names = make_train_run(
        tmp_path, *FSDP, "train.batch_tokens=60", "train.epochs=3", "train.save_every_steps=1"
    )
    run, log = Path(config.run_dir), Path(config.run_dir) / "train" / "log.jsonl"
    Trainer(accumulating(config, 12), names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None).train()
    reference, reference_weights = lines(log), weights(run)
    assert [x["step"] for x in reference] == [1, 2, 3, 4, 5, 6]
    for sub in ("checkpoints", "train"):  # the same run directory, trained again from the start in legs
        shutil.rmtree(run / sub)

    def on_the_curve(last: int) -> None:
        got = lines(log)
        assert [x["step"] for x in got] == list(range(1, last + 1)), "no step lost, none repeated"
        for x, y in zip(reference, got):
            assert abs(x["loss"] - y["loss"]) < 1e-4 * max(1, x["loss"]) and x["tokens"] == y["tokens"], (x, y)

    first = kill_after_a_checkpoint(accumulating(config, 6), names, nproc=2, past=0)
    assert (first["world_size"], first["grad_accum"]) == (2, 6) and 1 <= first["step"] < 5, first
    second = kill_after_a_checkpoint(accumulating(config, 3), names, nproc=4, past=first["step"])
    assert (second["world_size"], second["grad_accum"]) == (4, 3) and first["step"] < second["step"] < 6, second
    on_the_curve(len(lines(log)))  # 2 processes' steps, then what 4 trained from their checkpoint
    out = torchrun(accumulating(config, 4), names, nproc=3)
    assert f"(step {second['step']} of 6)" in out.stdout, "3 processes resumed from the 4 processes' checkpoint"
    on_the_curve(6)
    trained = weights(run)
    for name in reference_weights:
        torch.testing.assert_close(
            reference_weights[name], trained[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )
