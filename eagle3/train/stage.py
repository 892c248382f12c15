"""Stage ``train``: launch torchrun over the drafter's training and account for it.

The Prefect task calls ``run_train``: it checks the inputs (tokenized shards, their columns and
the tokenizer they were made with, the draft vocabulary, stored states or online settings, layer
ids the extraction used), writes the request file, starts ``torchrun`` as a subprocess in its own
process group under ``train.timeout_s`` (gloo on CPU, nccl on GPU: the worker picks), streams
every output line to the logger, and records the manifest entry from ``train/result.json``. A
rerun resumes from ``checkpoints/latest.json``; a run that already reached its last step does no further step.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from eagle3.cluster.train import run_on_cluster
from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import atomic_write_json, read_json, remove_inside
from eagle3.errors import TrainFailed, run_first
from eagle3.layout import RunLayout
from eagle3.markers import remove_marker, write_marker
from eagle3.run_facts import RunFacts
from eagle3.torchrun import torchrun_env
from eagle3.train.errors import TrainDataError, TrainInputError

STAGE = "train"

STEP_LINE = re.compile(r"\[rank 0\] step (\d+)/(\d+)")
# A worker's failed write (disk full) reaches us only as its traceback's last line; it is raised
# here as the same DiskWriteError, so the user sees one line naming the file, not torchrun's dump.
DISK_ERROR_LINE = re.compile(r"\bDiskWriteError: (.+)$")


def check_tokenized(facts: RunFacts, shards: list[str]) -> None:
    """Each tokenized shard is complete, has the columns training reads, and was made with the
    tokenizer the config points at now: checked here, before torchrun starts, so a bad input is one
    clear error rather than a worker's traceback."""
    from eagle3.schemas import (
        TOKENIZED_IDS,
        TOKENIZED_INPUT_IDS,
        TOKENIZED_LOSS_MASK,
        check_schema,
        check_tokenizer,
    )

    tok_path, tok_hash = facts.tokenizer()
    for shard in shards:
        files = facts.layout.tokenized_files(shard)
        path, done = files["parquet"], facts.tokenized_done(shard)
        if done is None:
            raise TrainDataError(f"{path}: not tokenized (no {files['done'].name}); run `eagle3 tokenize`")
        check_schema(path, (TOKENIZED_IDS, TOKENIZED_INPUT_IDS, TOKENIZED_LOSS_MASK), "tokenized shard")
        check_tokenizer(done.fields, done.path, tok_path, tok_hash, "train")


def torchrun_argv(config: PipelineConfig, request: Path) -> list[str]:
    t = config.train
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={t.nproc_per_node}",
        f"--nnodes={t.nnodes}",
    ]
    if t.nnodes > 1:
        argv += [
            f"--node-rank={t.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={t.rdzv_endpoint}",
            f"--rdzv-id={t.rdzv_id}",
        ]
    else:
        host, _, port = t.rdzv_endpoint.rpartition(":")
        argv += ["--standalone"] if not port else [f"--master-addr={host or '127.0.0.1'}", f"--master-port={port}"]
    return argv + ["-m", "eagle3.train.worker", str(request)]


def run_train(facts: RunFacts, shards: list[str], logger=None, on_line=None) -> dict:
    """Train on ``shards`` with the run's facts (the target, the tokenizer, the layers extraction
    used). ``on_line(line)`` sees every output line of torchrun (the Prefect task moves a progress
    artifact from the ``step N/M`` lines)."""
    log = logger or logging.getLogger(__name__)
    config, layout = facts.config, facts.layout
    run = layout.root
    vocab = layout.draft_vocab
    if not vocab.exists():
        raise TrainInputError(STAGE, vocab, run_first("eagle3 vocab"))
    layer_ids = facts.extracted_layer_ids(STAGE)
    check_tokenized(facts, shards)
    layout.train.mkdir(parents=True, exist_ok=True)
    request = layout.train_request
    result_path = layout.train_result
    remove_marker(layout.train_marker, run)
    remove_inside(result_path, run)
    atomic_write_json(
        request,
        {
            "config": json.loads(config.model_dump_json()),
            "shards": shards,
            "model_path": facts.model_dir(),
            "layer_ids": layer_ids,
            "result_path": str(result_path),
        },
    )
    started = time.monotonic()
    if config.cluster.runs(STAGE):
        _run_on_cluster(config, request, log, on_line)
    else:
        argv = torchrun_argv(config, request)
        log.info("train: %s", " ".join(argv))
        threads = max(1, (os.cpu_count() or 1) // config.train.nproc_per_node)  # a core share, not oversubscribed
        _run_streamed(
            argv,
            config.train.timeout_s,
            log,
            cwd=Path(__file__).resolve().parents[2],
            threads=threads,
            on_line=on_line,
            pidfile=layout.torchrun_pid,
            drop_env=(config.server.api_key_env,),
        )
    result = read_json(result_path)
    # world_size (result.json) is what the workers counted: nnodes x nproc_per_node, on a cluster too.
    return record(config, result, layer_ids, time.monotonic() - started)


def _run_on_cluster(config: PipelineConfig, request: Path, log, on_line) -> None:
    """torchrun on train.nnodes Ray nodes (eagle3/cluster/train.py). Each process gets
    cluster.train_cpus_per_process threads (what Ray reserved for it) unless OMP_NUM_THREADS is set
    here; the request path is absolute, since the nodes run in the flow's working directory."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, int(config.cluster.train_cpus_per_process)))
    watch, disk_errors = _watcher(on_line)
    try:
        run_on_cluster(config, Path(request).resolve(), log, on_line=watch, threads=threads)
    except TrainFailed:
        _raise_disk_error(disk_errors)
        raise


def _watcher(on_line):
    """A line hook that notes a worker's DiskWriteError line and passes every line to ``on_line``."""
    disk_errors: list[str] = []

    def watch(line: str) -> None:
        if found := DISK_ERROR_LINE.search(line):
            disk_errors.append(found.group(1))
        if on_line is not None:
            on_line(line)  # a failing progress display is logged by the pump, never stops training

    return watch, disk_errors


def _raise_disk_error(disk_errors: list[str]) -> None:
    """A worker's failed write (disk full) as the one DiskWriteError naming the file."""
    if disk_errors:
        from eagle3.durable import DiskWriteError

        raise DiskWriteError(errno.EIO, disk_errors[0])


def _run_streamed(
    argv: list[str],
    timeout_s: float,
    log,
    cwd: Path,
    threads: int,
    on_line=None,
    pidfile: Path | None = None,
    drop_env: tuple[str, ...] = (),
) -> None:
    """Run torchrun as a child process group (eagle3/proc.py) under ``timeout_s``; every output line
    goes to ``log`` and ``on_line``. The group dies with this process, even by SIGKILL; with
    ``pidfile``, a torchrun a SIGKILLed run left behind (it would train into the same checkpoints)
    is stopped first. ``drop_env``: names torchrun must not inherit besides secret_env's."""
    from eagle3 import proc

    watch, disk_errors = _watcher(on_line)
    try:
        done = proc.run(
            argv,
            timeout_s=timeout_s,
            name="torchrun",
            logger=log,
            env=torchrun_env(threads, drop=drop_env),
            cwd=cwd,
            pidfile=pidfile,
            grace_s=15.0,
            on_line=watch,
        )
    except proc.DeadlineExceeded:
        raise TrainFailed(
            f"torchrun ran past train.timeout_s={timeout_s:.0f} s and was stopped; rerun to resume from the last "
            "checkpoint"
        ) from None
    code = done.returncode
    if code != 0:
        _raise_disk_error(disk_errors)
        raise TrainFailed(f"torchrun exited with code {code}; last lines:\n" + "\n".join(done.tail()[-20:]))


def record(config: PipelineConfig, result: dict, layer_ids: list[int], seconds: float) -> dict:
    from eagle3.manifest import record_stage, versions
    from eagle3.results import StageCounts

    steps = int(result["steps"])
    layout = RunLayout.of(config)
    results = {
        "total_steps": result["total_steps"],
        "best": result["best"],
        "tokens": result["tokens"],
        "world_size": result["world_size"],
        "layer_ids": layer_ids,
        "checkpoints": str(layout.checkpoints),
    }
    entry = record_stage(
        config.run_dir,
        STAGE,
        StageCounts(steps, steps),
        status="ok",
        counted="optimizer steps",
        **results,
        seconds=round(seconds, 1),
        config_hash=section_hash(config.train),
        versions=versions("torch"),
    )
    write_marker(layout.train_marker, STAGE, section_hash(config.train), {"in": steps, "ok": steps}, **results)
    return entry


def summary_line(entry: dict, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    run = Path(run_dir)
    best = entry.get("best") or {}
    return (
        f"drafter:      {run / 'checkpoints'}  (best: step {best.get('step')}, held-out acceptance length "
        f"{best.get('acceptance_length', 0):.3f}; curves: {run / 'train' / 'curves.png'})"
    )
