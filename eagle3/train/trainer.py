"""The training loop: one process, or one of many under torchrun (DDP or FSDP).

Run by ``eagle3.train.worker`` (what torchrun launches) or called directly with ``world=1``.
Rank 0 writes everything: ``train/log.jsonl`` (a line per optimizer step), ``train/eval.jsonl``
(a line per evaluation), ``checkpoints/step-NNNNNN/`` and ``checkpoints/latest.json`` /
``best.json``.

Checkpoints hold the drafter's trainable state (safetensors, float32 master weights), the
optimizer state (``optimizer.pt``, loaded back with ``weights_only=True``: tensors and numbers,
never arbitrary pickles) and ``trainer_state.json`` (step, epoch, best). The learning rate is a
pure function of the step and the data order a pure function of (seed, epoch), and nothing is
random after initialisation (train.hidden_noise's noise is a function of the step and the batch: see
levers.py), so a resumed run repeats the uninterrupted run's steps exactly, on any number of
processes at the same global batch (processes x grad_accum micro-batches of batch_tokens: 2 x 6
resumes on 4 x 3); a checkpoint written at another global batch is refused naming both
(checkpoint.check_global_batch).
Each checkpoint is written to a hidden folder and renamed; ``latest.json`` moves last. A write that
fails (disk full) raises ``DiskWriteError`` naming the checkpoint, removes the hidden folder and
leaves ``latest.json`` on the previous checkpoint, which a rerun resumes from.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from eagle3.config import PipelineConfig
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.durable import (
    atomic_folder,
    atomic_write_json,
    read_json,
    sweep_orphaned_temporaries,
    writing,
)
from eagle3.layout import RunLayout
from eagle3.train import levers, optim
from eagle3.train.checkpoint import as_os_error, check_global_batch, load_tensors_only, optimizer_format
from eagle3.train.chunked import ChunkedTTTLoss, chunked_target_view
from eagle3.train.data import (
    Dataset,
    collate,
    counted_positions,
    epoch_steps,
    micro_batches,
)
from eagle3.train.loss import summarize, target_view, ttt_loss
from eagle3.train.target import load_target_head

CKPT_FORMAT = "eagle3-train-checkpoint/1"


def lr_at(step: int, total: int, config) -> float:
    """Linear warmup, then cosine from learning_rate down to learning_rate x min_lr_ratio."""
    warmup = int(total * config.warmup_fraction)
    if step < warmup:
        return config.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    floor = config.learning_rate * config.min_lr_ratio
    return floor + (config.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class Dist:
    """Rank, world size and collectives; a no-op for one process."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend)
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class Trainer:
    def __init__(
        self,
        config: PipelineConfig,
        shards: list[str],
        model_path: str,
        layer_ids: list[int],
        dist: Dist | None = None,
        log=print,
    ):
        self.config, self.tc, self.log = config, config.train, log
        self.dist = dist or Dist()
        self.run = Path(config.run_dir)
        self.layout = RunLayout.of(config)
        self.model_path, self.layer_ids = model_path, layer_ids
        torch.manual_seed(self.tc.seed)
        self.target = load_target_head(model_path)
        from eagle3.vocab.mapping import load as load_vocab

        d2t, t2d = (torch.from_numpy(x) for x in load_vocab(self.layout.draft_vocab))
        norms = {"norm_before_fc": self.tc.norm_before_fc, "norm_output": self.tc.norm_output}  # EAGLE-3.1
        self.drafter_config = DrafterConfig.from_target(self.target.config, len(d2t), layer_ids, **norms)
        model = Eagle3Drafter(self.drafter_config)
        model.init_from_target(self.target.embed, self.target.lm_head, d2t, t2d)
        levers.start(model, self.tc, model_path, layer_ids, self.target.norm_weight, log)  # warm start, frozen head
        self.model = model.to(self.dist.device)
        self.target = self.target.to(self.dist.device)
        self.data = Dataset(self.run, shards, self.tc.eval_fraction, offline=config.extract.mode == "offline")
        self.extractor = None
        if config.extract.mode == "online":
            from eagle3.extract.hf import cached_extractor

            self.extractor = cached_extractor(
                model_path, layer_ids, config.extract.dtype, self.dist.local_rank, max(self.dist.world, 1)
            )
        self.batches = micro_batches(self.data.train, self.tc.batch_tokens)
        self.steps_per_epoch = math.ceil(len(self.batches) / (self.dist.world * self.tc.grad_accum))
        self.total_steps = self.steps_per_epoch * self.tc.epochs
        if self.tc.max_steps is not None:  # a fixed compute budget: the schedule spans the capped run
            self.total_steps = min(self.total_steps, self.tc.max_steps)
        self.wrapped = self._wrap()
        self.trainable = [
            p for p in self.model.parameters() if p.requires_grad
        ]  # after wrapping: FSDP swaps in sharded parameters
        self.optimizer = optim.build(self.model, self.trainable, self.tc)  # train.optimizer
        self.step, self.best, self.tokens_global = 0, None, 0
        self.ckpt_dir = self.layout.checkpoints
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.dist.device.type == "cuda" and self.tc.dtype == "bfloat16"
            else nullcontext()
        )

    def _wrap(self):
        wrapped = self._distributed()
        return torch.compile(wrapped, dynamic=True) if self.tc.compile else wrapped

    def _distributed(self):
        if self.dist.world == 1:
            return self.model
        if self.tc.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model)
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            self.model, device_ids=[self.dist.device.index] if self.dist.device.type == "cuda" else None
        )

    # -- one micro-batch -------------------------------------------------------------------

    def _forward(self, samples, global_counts, training: bool = False):
        ids, mask, valid, aux, last = collate(samples, self.data)
        if self.extractor is not None:
            states = self.extractor.states([s.input_ids.tolist() for s in samples])
            aux = torch.zeros((len(samples), ids.shape[1], states[0][0].shape[-1]))
            last = torch.zeros((len(samples), ids.shape[1], states[0][1].shape[-1]))
            for b, (a, h) in enumerate(states):
                aux[b, : len(a)], last[b, : len(h)] = (
                    a.to(torch.bfloat16).float(),
                    h.to(torch.bfloat16).float(),
                )  # as if stored
        dev = self.dist.device
        ids, mask, valid, aux, last = ids.to(dev), mask.to(dev), valid.to(dev), aux.to(dev).float(), last.to(dev)
        if self.tc.hidden_noise > 0 and training:
            aux = levers.noisy(aux, valid, self.tc, self.step, [s.id for s in samples])
        chunk, K = self.tc.loss_chunk_tokens, self.tc.ttt_steps
        with torch.no_grad():
            if chunk:
                view = chunked_target_view(self.target, last, self.model.d2t, self.model.t2d, chunk)
            else:
                view = target_view(self.target.logits(last), self.model.d2t, self.model.t2d)
        if chunk:  # the loss runs inside the drafter's forward, where DDP/FSDP see its lm_head weight
            head = ChunkedTTTLoss(view, mask, self.model.d2t, self.tc.step_weight_decay, global_counts, K, chunk)
            with self.autocast:
                return head.finish(self.wrapped(ids, aux, valid, K, head=head))
        with self.autocast:  # through the wrapper's forward, so DDP/FSDP hooks run
            logits = self.wrapped(ids, aux, valid, K)
        return ttt_loss(logits, view, mask, self.model.d2t, self.tc.step_weight_decay, global_counts)

    # -- the loop --------------------------------------------------------------------------

    def train(self) -> dict:
        self._resume()
        started = time.perf_counter()
        for epoch in range(self.step // self.steps_per_epoch, self.tc.epochs):
            if self.step >= self.total_steps:
                break
            plan = epoch_steps(len(self.batches), self.tc.seed, epoch, self.dist.world, self.tc.grad_accum)
            for i, per_rank in enumerate(plan):
                if epoch * self.steps_per_epoch + i < self.step:
                    continue
                if self.step >= self.total_steps:  # train.max_steps reached
                    break
                t0 = time.perf_counter()
                stats, tokens = self._optimizer_step(per_rank)
                self.step += 1
                self._log_step(epoch, stats, tokens, time.perf_counter() - t0)
                end_of_epoch = i == len(plan) - 1 or self.step == self.total_steps
                evaluate = (self.tc.eval_every_steps and self.step % self.tc.eval_every_steps == 0) or (
                    not self.tc.eval_every_steps and end_of_epoch
                )
                if evaluate:
                    self._evaluate(epoch)
                if evaluate or self.step % self.tc.save_every_steps == 0 or self.step == self.total_steps:
                    self.save()
        elapsed = time.perf_counter() - started
        return {
            "steps": self.step,
            "total_steps": self.total_steps,
            "best": self.best,
            "seconds": elapsed,
            "tokens": self.tokens_global,
        }

    def _optimizer_step(self, per_rank):
        lr = lr_at(self.step, self.total_steps, self.tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        everyone = [self.data.train[j] for mine in per_rank for b in mine for j in self.batches[b]]
        global_counts = counted_positions(everyone, self.tc.ttt_steps)
        mine = per_rank[self.dist.rank]
        step_stats, tokens = [], 0
        scale = self.dist.world  # DDP and FSDP average gradients over processes; the loss is already a global mean
        # Every process runs as many passes as the fullest one (FSDP's forward and backward are collectives):
        # in the epoch's short last step a process short of micro-batches makes up the count with the
        # step's first micro-batch at loss x 0, so the update is the same as with one process.
        padding = [(next(b for r in per_rank for b in r), 0.0)] * (max(len(r) for r in per_rank) - len(mine))
        work = [(b, 1.0) for b in mine] + padding
        for n, (b, weight) in enumerate(work):
            samples = [self.data.train[j] for j in self.batches[b]]
            sync = n == len(work) - 1
            ctx = self.wrapped.no_sync() if (hasattr(self.wrapped, "no_sync") and not sync) else nullcontext()
            with ctx:
                loss, stats = self._forward(samples, global_counts, training=True)
                (loss * (scale * weight)).backward()
            if weight:
                step_stats.append(stats)
                tokens += sum(len(s.input_ids) for s in samples)
        torch.nn.utils.clip_grad_norm_(self.trainable, self.tc.grad_clip)
        self.optimizer.step()
        return step_stats, tokens

    def _log_step(self, epoch, stats_list, tokens, seconds) -> None:
        K = self.tc.ttt_steps
        local = (
            [sum(s["ce_sum"][k] for s in stats_list) for k in range(K)]
            + [sum(s["counted"][k] for s in stats_list) for k in range(K)]
            + [tokens]
        )
        total = self.dist.sum(local)
        ce, counted, tokens_all = total[:K], total[K : 2 * K], int(total[-1])
        self.tokens_global += tokens_all
        per_step = [ce[k] / max(counted[k], 1) for k in range(K)]
        if self.dist.rank == 0:
            line = {
                "step": self.step,
                "epoch": epoch,
                "lr": lr_at(self.step - 1, self.total_steps, self.tc),
                "loss": sum((self.tc.step_weight_decay**k) * per_step[k] for k in range(K)),
                "loss_per_step": per_step,
                "tokens": tokens_all,
                "seconds": round(seconds, 4),
                "tokens_per_s": round(tokens_all / max(seconds, 1e-9), 1),
            }
            _append(self.layout.train_log, line)
            if self.step == 1 or self.step % 10 == 0 or self.step == self.total_steps:
                self.log(
                    f"step {self.step}/{self.total_steps} epoch {epoch} loss {line['loss']:.4f} lr "
                    f"{line['lr']:.2e} {line['tokens_per_s']:.0f} tokens/s"
                )

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        K = self.tc.ttt_steps
        batches = micro_batches(self.data.heldout, self.tc.batch_tokens)
        stats = []
        for b in batches:
            samples = [self.data.heldout[j] for j in b]
            counts = counted_positions(samples, K)
            _, s = self._forward(samples, counts)
            stats.append(s)
        return summarize(stats, K)

    def _evaluate(self, epoch) -> None:
        # Every process runs it (FSDP's forward is collective); rank 0 writes.
        self.model.eval()
        metrics = self.evaluate()
        self.model.train()
        if self.dist.rank == 0:
            line = {"step": self.step, "epoch": epoch, **metrics, "heldout_samples": len(self.data.heldout)}
            _append(self.layout.train_eval, line)
            if self.best is None or metrics["acceptance_length"] > self.best["acceptance_length"]:
                self.best = {"step": self.step, "acceptance_length": metrics["acceptance_length"]}
            self.log(
                f"eval at step {self.step}: acceptance length {metrics['acceptance_length']:.3f}, accuracy "
                f"{[round(a, 3) for a in metrics['accuracy']]}"
            )
        self.dist.barrier()

    # -- checkpoints -----------------------------------------------------------------------

    def _full_state(self):
        if self.tc.strategy == "fsdp" and self.dist.world > 1:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(self.model, options=opts), get_optimizer_state_dict(
                self.model, self.optimizer, options=opts
            )
        return self.model.state_dict(), self.optimizer.state_dict()

    def save(self) -> None:
        model_state, opt_state = self._full_state()
        if self.dist.rank == 0:
            layout = RunLayout.of(self.run)
            final = layout.checkpoint(self.step)
            # A save that a kill cut short left its partial folder under the dead worker's pid (and
            # possibly another step's name, when the schedule changed): removed before this one.
            sweep_orphaned_temporaries(self.ckpt_dir)
            # A failed write (disk full) leaves no step folder and no partial one, and latest.json
            # still names the previous checkpoint: the error names this one and the free space.
            with writing(final, "train: checkpoint"):
                try:
                    with atomic_folder(final) as tmp:
                        self._write_checkpoint(tmp, model_state, opt_state)
                except Exception as exc:
                    as_os = as_os_error(exc)
                    if as_os is None or as_os is exc:
                        raise
                    raise as_os from exc
                atomic_write_json(layout.latest_checkpoint, {"step": self.step, "path": str(final.resolve())})
                if self.best is not None and self.best["step"] == self.step:
                    atomic_write_json(layout.best_checkpoint, {**self.best, "path": str(final.resolve())})
        self.dist.barrier()

    def _write_checkpoint(self, tmp: Path, model_state, opt_state) -> None:
        from safetensors.torch import save_file

        weights = {k: v.detach().cpu().contiguous() for k, v in model_state.items() if k != "embed_tokens.weight"}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": CKPT_FORMAT})
        torch.save(opt_state, tmp / "optimizer.pt")
        (tmp / "drafter_config.json").write_text(self.drafter_config.to_json())
        atomic_write_json(
            tmp / "trainer_state.json",
            {
                "step": self.step,
                "total_steps": self.total_steps,
                "best": self.best,
                "seed": self.tc.seed,
                "layer_ids": self.layer_ids,
                "target": self.model_path,
                "strategy": self.tc.strategy,
                "world_size": self.dist.world,
                "grad_accum": self.tc.grad_accum,
                "batch_tokens": self.tc.batch_tokens,
            },
        )

    def _load_state(self, path: Path, state: dict, weights: dict, opt_state: dict) -> None:
        """Load a checkpoint's full (unsharded) state into this run's model and optimizer.

        Checkpoints always hold the full state, so one written by N processes loads on any M (each
        FSDP rank takes its own shard of it). Under FSDP the model's parameters are DTensors, so the
        state goes through the state-dict API (set_model_state_dict / set_optimizer_state_dict with
        full_state_dict), never a plain load_state_dict, which fails on them ("mixed torch.Tensor and
        DTensor"). The optimizer state's format follows the strategy that wrote it: FSDP's is keyed
        by parameter name, one process's and DDP's by position; a checkpoint of the other kind is
        refused with both strategies named."""
        fsdp = self.tc.strategy == "fsdp" and self.dist.world > 1
        wanted, found = ("fqn" if fsdp else "index"), optimizer_format(opt_state)
        if wanted != found:
            written = state.get("strategy") or ("fsdp" if found == "fqn" else "ddp or one process")
            now = f"{self.tc.strategy} on {self.dist.world} process(es)"
            raise ValueError(
                f"{path}: written by {written} on {state.get('world_size', '?')} process(es), this run is {now}; "
                "its optimizer state cannot be carried across (rerun with the strategy that wrote it, or delete "
                "the checkpoints folder to start over)"
            )
        if not fsdp:
            self.model.load_state_dict(weights, strict=False)
            self.optimizer.load_state_dict(opt_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, weights, options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, opt_state, options=opts)

    def _resume(self) -> None:
        latest = self.layout.latest_checkpoint
        if not latest.exists():
            return
        from safetensors.torch import load_file

        # By name inside this run's checkpoints folder: a run dir that was moved or copied resumes from
        # its own checkpoints, never from a folder outside it that the recorded absolute path names.
        path = self.ckpt_dir / Path(read_json(latest)["path"]).name
        state = read_json(path / "trainer_state.json")
        check_global_batch(path, state, self.dist.world, self.tc.grad_accum, self.tc.batch_tokens)
        weights = load_file(str(path / "model.safetensors"))
        missing = set(self.model.state_dict()) - set(weights) - {"embed_tokens.weight"}
        if missing:
            raise ValueError(f"{path}/model.safetensors lacks {sorted(missing)}: not a checkpoint of this drafter")
        self._load_state(path, state, weights, load_tensors_only(path / "optimizer.pt", self.dist.device))
        self.step, self.best = int(state["step"]), state.get("best")
        if self.dist.rank == 0:
            _truncate_jsonl(self.layout.train_log, self.step)
            _truncate_jsonl(self.layout.train_eval, self.step)
            self.log(f"resumed from {path} (step {self.step} of {self.total_steps})")


def _append(path: Path, line: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, "train"), open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop lines written after the checkpoint a run resumes from, so the log has no duplicates."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    from eagle3.durable import atomic_write_bytes

    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())
