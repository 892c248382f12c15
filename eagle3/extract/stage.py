"""Stage ``extract``: tokenized shards -> the target's hidden states, per shard.

- Inputs: ``tokenized/shard-K.parquet`` (complete when ``shard-K.done.json`` exists).
- Outputs (offline mode): ``hidden_states/shard-K.safetensors`` (see ``store``), the index
  ``shard-K.index.json`` (sample ids in row order, token counts, layer ids, model) and the marker
  ``shard-K.done.json`` last, keyed on the tokenized shard's hash, the model, the layer ids, the
  dtype and the backend: same inputs, no work; anything changed, the shard is extracted again.
- Before any work the stage adds up the bytes the missing shards need (tokens x 4 x H x 2 in bf16,
  about half in fp8) and refuses to start when the run directory's filesystem has less free space, naming both numbers.
- Online mode stores nothing: it checks the target's layer ids and writes ``online.json``, the
  settings training uses to run the same extraction per batch.
- Speed (HF backend, benchmarks/bench_extract.py): token ids are read column-wise (no Python int per
  token), batches are bucketed by length and stored whole (one finiteness check per batch, then
  one ``pwrite`` per sample and tensor); on a GPU a writer thread stores one batch while the next
  is computed (at most ``WRITE_AHEAD`` waiting), so the stage runs near a bare forward of the target.
- Accounting per shard: ``in`` = tokenized rows = ``ok`` (rows with stored states). A forward
  that fails fails the shard (its task retries); a shard is never half-written.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import atomic_write_json, remove_inside, sha256_file, writing
from eagle3.errors import MissingInputError, run_first
from eagle3.extract.errors import DiskSpaceError, StatesError
from eagle3.extract.store import StatesWriter, states_bytes, token_bytes
from eagle3.layout import RunLayout
from eagle3.markers import Marker, read_marker, remove_marker, write_marker
from eagle3.run_facts import RunFacts, read_tokenized_done

STAGE = "extract"
DISK_MARGIN = 1.02  # headers, index files and filesystem slack on top of the tensors themselves


@dataclass(frozen=True)
class ExtractResult:
    shard: str
    path: str
    in_: int
    ok: int
    tokens: int
    seconds: float
    skipped: bool


def _paths(run_dir: Path, shard: str) -> dict[str, Path]:
    layout = RunLayout.of(run_dir)
    tokenized = layout.tokenized_files(shard)
    return {"tokenized": tokenized["parquet"], "tok_done": tokenized["done"], **layout.states_files(shard)}


def _tokenized_marker(p: dict, shard: str) -> Marker:
    marker = read_tokenized_done(p["tok_done"])
    if marker is None:
        raise _not_tokenized(p, shard)
    return marker


def _key(config: PipelineConfig, tokenized_sha: str, fingerprint: str, layer_ids: list[int]) -> str:
    hs = config.extract
    parts = [tokenized_sha, fingerprint, json.dumps(layer_ids), hs.dtype, hs.backend]
    if hs.storage_dtype != "bfloat16":  # bf16 shards written before fp8 existed keep their keys
        parts.append(hs.storage_dtype)
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:16]


def _not_tokenized(p: dict, shard: str) -> MissingInputError:
    problem = f"not found: shard {shard} has not been tokenized"
    return MissingInputError("extract", p["tok_done"], run_first("eagle3 tokenize"), problem)


def _tokenized(p: dict, shard: str) -> tuple[list[str], list[np.ndarray]]:
    """Row ids and each row's input ids (int64 views into one array read column-wise: no Python
    int per token), every row checked against its ``num_tokens``."""
    _tokenized_marker(p, shard)
    try:
        table = pq.read_table(p["tokenized"], columns=["id", "input_ids", "num_tokens"])
    except Exception as exc:
        problem = f"is not a readable tokenized shard ({exc})"
        raise MissingInputError("extract", p["tokenized"], run_first("eagle3 tokenize", again=True), problem) from None
    ids = table.column("id").to_pylist()
    column = table.column("input_ids").combine_chunks()
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    declared = table.column("num_tokens").to_numpy().astype(np.int64)
    bad = np.flatnonzero((lengths != declared) | (lengths == 0))
    if len(bad):
        k = int(bad[0])
        problem = f"row {ids[k]!r} has {lengths[k]} input ids but num_tokens={declared[k]}"
        raise MissingInputError("extract", p["tokenized"], run_first("eagle3 tokenize", again=True), problem)
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return ids, np.split(flat, np.cumsum(lengths)[:-1])


@dataclass(frozen=True)
class Plan:
    """Per shard: its key and whether its states are already complete on disk; with the run's facts
    the shard tasks need (the target's folder and depth), so a task never resolves them again."""

    layer_ids: list[int]
    hidden_size: int
    fingerprint: str
    keys: dict[str, str]
    done: dict[str, bool]
    tokens: dict[str, int]
    storage: str = "bfloat16"
    model_path: str = ""
    num_layers: int = 0

    @property
    def bytes_needed(self) -> int:
        todo = sum(self.tokens[s] for s, d in self.done.items() if not d)
        return int(states_bytes(todo, self.hidden_size, self.storage) * DISK_MARGIN)


def plan(facts: RunFacts, shards: list[str]) -> Plan:
    """Layer ids, keys and the disk bill, from the tokenized markers and the run's facts (the target,
    its tapped layers, the tokenizer). Every shard is checked first (its hash, its columns, the
    tokenizer it was made with), so a bad input stops the stage before any forward pass."""
    from eagle3.extract.hf import model_fingerprint
    from eagle3.schemas import TOKENIZED_IDS, TOKENIZED_INPUT_IDS, TOKENIZED_NUM_TOKENS, check_schema, check_tokenizer

    config, path, (tok_path, tok_hash) = facts.config, facts.model_dir(), facts.tokenizer()
    layers, hidden = facts.target_shape()
    layer_ids = facts.layer_ids
    fingerprint = model_fingerprint(path)
    keys, done, tokens = {}, {}, {}
    for shard in shards:
        p = _paths(facts.layout.root, shard)
        marker = facts.tokenized_marker(shard, STAGE)
        if not p["tokenized"].exists() or sha256_file(p["tokenized"]) != marker["parquet_sha256"]:
            problem = (
                f"is missing or differs from what the tokenize stage wrote (its hash is in {p['tok_done'].name}): "
                "truncated or replaced"
            )
            raise MissingInputError("extract", p["tokenized"], run_first("eagle3 tokenize", again=True), problem)
        check_schema(p["tokenized"], (TOKENIZED_IDS, TOKENIZED_INPUT_IDS, TOKENIZED_NUM_TOKENS), "tokenized shard")
        check_tokenizer(marker.fields, p["tok_done"], tok_path, tok_hash, "extract")
        keys[shard] = _key(config, marker["parquet_sha256"], fingerprint, layer_ids)
        tokens[shard] = int(marker["result"]["tokens"])
        done[shard] = _is_done(p, keys[shard])
    return Plan(layer_ids, hidden, fingerprint, keys, done, tokens, config.extract.storage_dtype, path, layers)


def _is_done(p: dict, key: str) -> bool:
    done = read_marker(p["done"], STAGE)
    if done is None or not p["states"].exists():
        return False
    return done.key == key and p["states"].stat().st_size == done.get("bytes")


def check_disk(config: PipelineConfig, the_plan: Plan) -> None:
    """Refuse to start when the missing shards' states would not fit, naming both numbers."""
    need = the_plan.bytes_needed
    if config.extract.mode == "online" or need == 0:
        return
    out = RunLayout.of(config).hidden_states
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < need:
        missing = sum(1 for d in the_plan.done.values() if not d)
        raise DiskSpaceError(
            f"extract: the states of {missing} shards need {_gib(need)} "
            f"({sum(t for s, t in the_plan.tokens.items() if not the_plan.done[s])} tokens "
            f"x {token_bytes(the_plan.hidden_size, the_plan.storage)} bytes ({the_plan.storage}), "
            f"+{round((DISK_MARGIN - 1) * 100)}%) "
            f"but {out} has only {_gib(free)} free. "
            'Free space, point run_dir at a larger disk, or set extract.mode="online" '
            "to compute states inside training."
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n} bytes)"


def extract_shard(
    config: PipelineConfig, shard: str, the_plan: Plan, replica: int = 0, logger=None, progress=None
) -> ExtractResult:
    """Extract one shard's states (skipped when its marker matches). ``progress(fraction)`` is
    called as samples are written (the Prefect task moves a progress artifact with it)."""
    log = logger or logging.getLogger(__name__)
    p = _paths(Path(config.run_dir), shard)
    key = the_plan.keys[shard]
    if _is_done(p, key):
        result = read_marker(p["done"], STAGE)["result"]
        return ExtractResult(**{**result, "skipped": True})
    remove_marker(p["done"], config.run_dir)
    ids, seqs = _tokenized(p, shard)
    started = time.perf_counter()
    hs = config.extract
    meta = {
        "model": config.server.model,
        "layer_ids": json.dumps(the_plan.layer_ids),
        "hidden_size": str(the_plan.hidden_size),
        "shard": shard,
    }
    with (
        writing(p["states"], "extract"),
        StatesWriter(p["states"], [len(s) for s in seqs], the_plan.hidden_size, meta, the_plan.storage) as writer,
    ):
        if hs.backend == "vllm":
            _fill_with_vllm(config, shard, ids, seqs, the_plan, writer, log)
        else:
            _fill_with_hf(config, seqs, the_plan, writer, replica, log, shard, progress)
        writer.commit()
    tokens = sum(len(s) for s in seqs)
    seconds = time.perf_counter() - started
    atomic_write_json(
        p["index"],
        {
            "shard": shard,
            "ids": ids,
            "num_tokens": [len(s) for s in seqs],
            "layer_ids": the_plan.layer_ids,
            "hidden_size": the_plan.hidden_size,
            "model": config.server.model,
            "dtype": the_plan.storage,
        },
    )
    result = ExtractResult(shard, str(p["states"]), len(ids), len(ids), tokens, round(seconds, 3), False)
    write_marker(
        p["done"],
        STAGE,
        key,
        {"in": result.in_, "ok": result.ok},
        bytes=p["states"].stat().st_size,
        result={k: v for k, v in result.__dict__.items() if k != "skipped"},
    )
    log.info(
        "%s: %d samples, %d tokens -> %s in %.1f s (%.0f tokens/s)",
        shard,
        len(ids),
        tokens,
        p["states"],
        seconds,
        tokens / max(seconds, 1e-9),
    )
    return result


WRITE_AHEAD = 2  # batches computed but not yet written: bounds the memory the overlap costs


def _fill_with_hf(
    config, seqs, the_plan: Plan, writer: StatesWriter, replica: int, log, shard: str, progress=None
) -> None:
    """Forward each length batch and store it whole (``StatesWriter.write_batch``).

    Where the forward runs on an accelerator a writer thread stores one batch while the next is
    computed (at most ``WRITE_AHEAD`` waiting): the GPU works while the CPU writes. On the CPU the
    forward already keeps every core busy, and a writer thread only takes turns with it (and with
    the GIL the forward's Python needs): measured on the 2-core machine with the tiny target, the
    thread made the stage 0.81x the bare forward, storing in line 0.90x (benchmarks/bench_extract.py).
    A write's error is raised here; on any failure the pending writes finish before the caller
    aborts the file."""
    from eagle3.extract.hf import cached_extractor

    hs = config.extract
    extractor = cached_extractor(the_plan.model_path, the_plan.layer_ids, hs.dtype, replica, hs.replicas)
    done, last_log, total = 0, time.monotonic(), len(seqs)

    def store(batch, aux, last) -> int:
        writer.write_batch(batch, aux, last)
        return len(batch)

    with _writes(extractor.device != "cpu", shard) as submit:
        for batch in extractor.iter_batches(seqs, hs.batch_tokens):
            for stored in submit(store, *batch):
                done += stored
                if time.monotonic() - last_log > 10:
                    last_log = _report(log, shard, done, total, last_log, progress)
        for stored in submit(None):
            done += stored
    _report(log, shard, done, total, last_log, progress)


@contextlib.contextmanager
def _writes(behind: bool, shard: str):
    """``submit(fn, *args)`` runs ``fn`` and yields the results of the calls that have finished:
    at once when not ``behind``; else on a writer thread, at most ``WRITE_AHEAD`` calls waiting.
    ``submit(None)`` waits for them all."""
    if not behind:

        def run_now(fn, *args):
            return [fn(*args)] if fn is not None else []

        yield run_now
        return
    from concurrent.futures import ThreadPoolExecutor

    pending = collections.deque()
    with ThreadPoolExecutor(1, thread_name_prefix=f"extract-write-{shard}") as pool:

        def run_behind(fn, *args):
            if fn is not None:
                pending.append(pool.submit(fn, *args))
            finished = []
            while pending and (fn is None or len(pending) > WRITE_AHEAD or pending[0].done()):
                finished.append(pending.popleft().result())
            return finished

        try:
            yield run_behind
        finally:
            for future in pending:  # a failure: no write may still run when the file is aborted
                future.cancel()


def _report(log, shard: str, done: int, total: int, last_log: float, progress) -> float:
    if time.monotonic() - last_log > 30:
        log.info("%s: %d/%d samples", shard, done, total)
    if progress is not None:
        progress(done / total)
    return time.monotonic()


def _fill_with_vllm(config, shard: str, ids, seqs, the_plan: Plan, writer: StatesWriter, log) -> None:
    """vLLM's own extraction, one worker (one vLLM start) per shard, in chunks of
    ``vllm_chunk_tokens`` that it hands over one by one (``stream_with_vllm``)."""
    import torch

    from eagle3.extract.vllm_backend import stream_with_vllm

    hs = config.extract
    layers = [*the_plan.layer_ids, the_plan.num_layers]
    work = RunLayout.of(config).vllm_work(shard)
    chunks, current, tokens = [], 0, 0
    for seq in seqs:
        if current and tokens + len(seq) > hs.vllm_chunk_tokens:
            chunks.append(current)
            current, tokens = 0, 0
        current += 1
        tokens += len(seq)
    chunks.append(current)
    log.info("%s: vLLM extraction, %d samples in %d chunks", shard, len(seqs), len(chunks))
    work.mkdir(parents=True, exist_ok=True)
    stream = stream_with_vllm(
        config.server.python or sys.executable,
        the_plan.model_path,
        layers,
        list(zip(ids, seqs)),
        chunks,
        work,
        hs.timeout_s,
        env=dict(config.server.env),
        log=log,
        drop_env=(config.server.api_key_env,),
    )
    try:
        start = 0
        for n, states in enumerate(stream):
            for k in range(start, start + chunks[n]):
                h = torch.from_numpy(states.pop(ids[k]))  # [T, 4, H]
                if h.shape[0] != len(seqs[k]):
                    raise StatesError(
                        f"{shard}: vLLM returned {h.shape[0]} positions for {ids[k]!r}, which has {len(seqs[k])} tokens"
                    )
                writer.write(k, h[:, :3, :].reshape(h.shape[0], -1), h[:, 3, :])
            start += chunks[n]
            log.info("%s: vLLM extraction, chunk %d/%d stored", shard, n + 1, len(chunks))
    finally:
        stream.close()  # a failure here stops the worker now, not when the traceback lets go of the stream
        remove_inside(work, config.run_dir, ignore_errors=True)


def write_online(config: PipelineConfig, the_plan: Plan, shards: list[str]) -> dict:
    """Online mode: the settings training extracts with, checked against the target now."""
    settings = {
        "model": config.server.model,
        "layer_ids": the_plan.layer_ids,
        "hidden_size": the_plan.hidden_size,
        "dtype": config.extract.dtype,
        "shards": shards,
        "tokens": sum(the_plan.tokens.values()),
    }
    atomic_write_json(RunLayout.of(config).online, settings)
    return settings


def record(config: PipelineConfig, results: list[ExtractResult], the_plan: Plan) -> dict:
    from eagle3.manifest import record_stage, versions
    from eagle3.results import StageCounts

    counts = StageCounts(sum(r.in_ for r in results), sum(r.ok for r in results))
    return record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="ok",
        mode=config.extract.mode,
        backend=config.extract.backend,
        layer_ids=the_plan.layer_ids,
        hidden_size=the_plan.hidden_size,
        storage_dtype=the_plan.storage,
        tokens=sum(r.tokens for r in results),
        bytes=sum(Path(r.path).stat().st_size for r in results if r.path and Path(r.path).is_file()),
        config_hash=section_hash(config.extract),
        model_fingerprint=the_plan.fingerprint,
        versions=versions("torch", "transformers", "safetensors"),
    )


def online_results(facts: RunFacts, shards: list[str], the_plan: Plan) -> list[ExtractResult]:
    """Online mode's accounting: every tokenized row will get its states inside training."""
    out = []
    for shard in shards:
        rows = int(facts.tokenized_marker(shard, STAGE)["result"]["ok"])
        out.append(ExtractResult(shard, "", rows, rows, the_plan.tokens[shard], 0.0, False))
    return out


def precheck(facts: RunFacts) -> None:
    """Before a flow run is recorded: the tokenized inputs exist and match, and the disk holds the states."""
    check_disk(facts.config, plan(facts, facts.shard_names(STAGE)))


def summary_line(entry: dict, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    run = Path(run_dir)
    where = f"{run / 'hidden_states'}" if entry["mode"] == "offline" else "computed inside training (online mode)"
    return (
        f"hidden states: {where}  (layers {entry['layer_ids']}, {entry['tokens']} tokens, "
        f"{entry['bytes'] / 2**20:.1f} MiB)"
    )
