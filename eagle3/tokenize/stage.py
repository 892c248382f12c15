"""Stage ``tokenize``: generation records -> ``input_ids`` + ``loss_mask`` Parquet, per shard.

Design choices:
- One task per shard, reading ``generations/shard-K.jsonl`` (and the prompt shard for the
  messages), writing ``tokenized/shard-K.parquet`` (zstd; row groups of ~1M tokens, a few MB,
  so a reader streams them), ``shard-K.counts.safetensors`` (supervised-token counts for the
  draft vocabulary), ``shard-K.rejected.jsonl`` (filtered rows with reasons) and the marker
  ``shard-K.done.json`` last. Accounting: ``in`` = generation records, ``in == ok + filtered``.
- The marker's key hashes the generation file, the prompt shard, the tokenizer files and the
  ``[tokenize]`` settings: same inputs, no work; anything changed, the shard is rebuilt.
- Server ids are checked against the chat template on a sample of rows; the mismatch rate goes
  in the manifest and is never hidden or fatal (a re-tokenized completion often differs from the
  tokens the model actually sampled, which is why the server's ids are preferred).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import (
    atomic_path,
    atomic_write_lines,
    install_file,
    read_json,
    remove_inside,
    sha256_file,
    writing,
)
from eagle3.errors import MissingInputError, run_first
from eagle3.layout import RunLayout
from eagle3.markers import read_marker, remove_marker, write_marker
from eagle3.reasoning import key_parts, template_kwargs
from eagle3.records import read_records
from eagle3.run_facts import RunFacts
from eagle3.schemas import PROMPT_COLUMNS, check_schema
from eagle3.tokenize.build import (
    RowError,
    Sample,
    answer_only,
    conversation,
    fit_length,
    from_template_batch,
    has_ids,
)
from eagle3.tokenize.rows import SourceTally, messages_of, server_sample
from eagle3.tokenizer import target_vocab_size, tokenizer_fingerprint

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_supervised", pa.int32()),
        ("path", pa.string()),
        ("truncated", pa.bool_()),
    ]
)
ROW_GROUP_TOKENS = 1 << 20
TEMPLATE_CHECKS = 64
CHUNK = 512  # template-path rows rendered and encoded together: at most this many,
CHUNK_CHARS = 1 << 17  # and about this much completion text (~30k tokens), so long rows still pipeline
IN_FLIGHT = 2  # chunks encoding at once: the Rust pool balances two batches across cores, one alone idles at its tail
STAGE = "tokenize"


# The stage's inputs (finished generation shards made with this config) are missing.
TokenizeInputError = MissingInputError


@dataclass(frozen=True)
class TokenizeResult:
    shard: str
    path: str
    in_: int
    ok: int
    filtered: int
    reasons: dict
    tokens: int
    supervised: int
    truncated: int
    template_check: dict
    skipped: bool
    per_source: dict = field(default_factory=dict)  # mixed runs: rows and tokens per source


def _paths(run_dir: Path, shard: str) -> dict[str, Path]:
    layout = RunLayout.of(run_dir)
    gen = layout.generation(shard)
    return {
        "generations": gen["ok"],
        "gen_meta": gen["meta"],
        "gen_done": gen["done"],
        "prompts": layout.prompt_shard(shard),
        **layout.tokenized_files(shard),
    }


def _check_generation_settings(facts: RunFacts, p: dict, shard: str) -> None:
    """Records made by another model, sampling or chat template than the config's are refused by name."""
    from eagle3.generate.shard import STAGE as GENERATE, generation_key

    made = read_marker(p["gen_done"], GENERATE).key
    if made is None:
        return
    model, template = facts.expected_target()
    gen = facts.config.generation
    if made != generation_key(model, gen, template, **facts.request_plan):
        meta = read_json(p["gen_meta"]) if p["gen_meta"].exists() else {}
        problem = (
            f"was made by model {meta.get('model', '?')!r} with sampling {meta.get('sampling', '?')}, but the "
            f"config asks for model {model!r} with max_tokens={gen.max_tokens}, temperature={gen.temperature}, "
            f"top_p={gen.top_p} (or another chat template)"
        )
        hint = f"run `eagle3 generate` for shard {shard} (earlier records are set aside, never mixed)"
        raise MissingInputError("tokenize", p["generations"], hint, problem)


def _key(p: dict, config: PipelineConfig, tok_fp: str) -> str:
    parts = [sha256_file(p["generations"]), sha256_file(p["prompts"]), tok_fp, section_hash(config.tokenize)]
    parts += key_parts(config.generation.reasoning)  # drop / disable change what is supervised
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:16]


def _text_size(record: dict) -> int:
    content, reasoning = record.get("content"), record.get("reasoning")
    return (len(content) if type(content) is str else 0) + (len(reasoning) if type(reasoning) is str else 0)


@dataclass
class _Acc:
    out: _Output | None = None  # kept rows stream to it; only their counts stay here
    kept: int = 0
    truncated: int = 0
    rejected: list = field(default_factory=list)
    reasons: dict = field(default_factory=dict)
    tokens: int = 0
    supervised: int = 0
    checks: dict = field(default_factory=lambda: {"checked": 0, "prompt_mismatch": 0, "full_mismatch": 0})
    sources: SourceTally = field(default_factory=SourceTally)

    def reject(self, record_id, kind: str, reason: str) -> None:
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
        self.sources.add(record_id, kept=False)
        self.rejected.append({"id": record_id, "kind": kind, "reason": reason})


def _keep(rid: str, sample: Sample, config: PipelineConfig, acc: _Acc) -> None:
    try:
        sample, truncated = fit_length(sample, config.tokenize.max_seq_len, config.tokenize.overflow)
    except RowError as err:
        acc.reject(rid, err.kind, str(err))
        return
    supervised = int(sample.loss_mask.sum())
    acc.tokens += len(sample.input_ids)
    acc.supervised += supervised
    acc.kept += 1
    acc.truncated += bool(truncated)
    acc.sources.add(rid, True, len(sample.input_ids), supervised)
    acc.out.add((rid, sample, supervised, truncated))


def _chunk(
    records: list[tuple[int, dict, tuple | None]],
    messages: dict,
    tokenizer,
    vocab: int,
    config: PipelineConfig,
    acc: _Acc,
    every: int,
    executor,
    kwargs: dict,
):
    """Start one chunk: server-id and drop rows one by one, template rows rendered together (with
    ``kwargs``, the reasoning mode's template variables) and their encode handed to ``executor``.
    Returns the function that finishes the chunk (in record order, rows refused while reading included)."""
    samples: dict[int, Sample | RowError] = {}
    pending: list[tuple[int, list[dict]]] = []
    for k, record, refused in records:
        if refused is not None:
            continue
        try:
            context = messages_of(record, messages)
            if config.generation.reasoning == "drop":  # the last answer only, its reasoning removed
                samples[k] = answer_only(tokenizer, context, record, vocab)
            elif has_ids(record):
                samples[k] = server_sample(record, context, tokenizer, vocab, acc.checks, k % every == 0, kwargs)
            else:
                pending.append((k, conversation(context, record)))
        except RowError as err:
            samples[k] = err
    encoded = from_template_batch(tokenizer, [c for _, c in pending], executor, kwargs)

    def finish() -> None:
        for (k, _), sample in zip(pending, encoded()):
            samples[k] = sample
        for k, record, refused in records:
            if refused is not None:
                acc.reject(record.get("id") if isinstance(record, dict) else None, *refused)
                continue
            sample = samples[k]
            if isinstance(sample, RowError):
                acc.reject(record.get("id"), sample.kind, str(sample))
            else:
                _keep(record["id"], sample, config, acc)

    return finish


def _list_array(seqs: list[np.ndarray], arrow_type) -> pa.ListArray:
    """Many arrays as one Arrow list column, built from one flat buffer (no per-item Python objects)."""
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in seqs], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(seqs), type=arrow_type))


def _table(batch: list) -> pa.Table:
    ids = [r[1].input_ids for r in batch]
    return pa.Table.from_arrays(
        [
            pa.array([r[0] for r in batch], pa.string()),
            _list_array(ids, pa.int32()),
            _list_array([r[1].loss_mask for r in batch], pa.uint8()),
            pa.array([len(x) for x in ids], pa.int32()),
            pa.array([r[2] for r in batch], pa.int32()),
            pa.array([r[1].path for r in batch], pa.string()),
            pa.array([r[3] for r in batch], pa.bool_()),
        ],
        schema=SCHEMA,
    )


class _Output:
    """Kept rows go to the shard's partial Parquet file as they come, a row group per
    ~ROW_GROUP_TOKENS (the groups, so the bytes, of writing them all at the end), and into the
    supervised-token counts: later chunks encode meanwhile and the stage's end has one group left."""

    def __init__(self, final: Path, vocab: int):
        self.final, self.tmp, self.vocab = final, final.with_name(f".{final.name}.partial"), vocab
        self.writer, self.batch, self.tokens = None, [], 0
        self.counts = np.zeros(vocab, dtype=np.int64)

    def add(self, row) -> None:
        self.batch.append(row)
        self.tokens += len(row[1].input_ids)
        if self.tokens >= ROW_GROUP_TOKENS:
            self._flush()

    def _flush(self) -> None:
        with writing(self.final, "tokenize"):
            if self.writer is None:
                self.tmp.parent.mkdir(parents=True, exist_ok=True)
                self.writer = pq.ParquetWriter(self.tmp, SCHEMA, compression="zstd")
            if self.batch:
                self.writer.write_table(_table(self.batch))
        if self.batch:
            counts = _counts(self.batch, self.vocab)
            if len(counts) > len(self.counts):
                counts[: len(self.counts)] += self.counts
                self.counts = counts
            else:
                self.counts[: len(counts)] += counts
        self.batch, self.tokens = [], 0

    def close(self) -> None:
        self._flush()
        self.writer.close()
        self.writer = None

    def discard(self) -> None:
        """After a failure: no partial file stays behind."""
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception:  # the file goes anyway
            pass
        remove_inside(self.tmp, self.final.parent)


def _counts(rows: list, vocab: int) -> np.ndarray:
    if not rows:
        return np.zeros(vocab, dtype=np.int64)
    ids = np.concatenate([r[1].input_ids for r in rows])
    mask = np.concatenate([r[1].loss_mask for r in rows]).astype(bool)
    return np.bincount(ids[mask], minlength=vocab).astype(np.int64)


def _save_outputs(p: dict, acc: _Acc) -> None:
    from safetensors.numpy import save_file

    with writing(p["parquet"], "tokenize"):  # the caller discards the partial file on failure
        acc.out.close()
        install_file(acc.out.tmp, p["parquet"])
        with atomic_path(p["counts"]) as counts_tmp:
            save_file({"counts": acc.out.counts}, str(counts_tmp))
        atomic_write_lines(p["rejected"], acc.rejected)


def tokenize_shard(facts: RunFacts, shard: str, tokenizer, logger=None) -> TokenizeResult:
    """Tokenize one generation shard with ``tokenizer`` (loaded from the run's tokenizer folder);
    skipped when its marker matches the inputs and settings."""
    log = logger or logging.getLogger(__name__)
    config, (tok_path, tok_hash) = facts.config, facts.tokenizer()
    p = _paths(facts.layout.root, shard)
    if not p["gen_done"].exists():
        problem = f"not found: shard {shard} has not finished generating"
        raise MissingInputError("tokenize", p["gen_done"], run_first("eagle3 generate"), problem)
    _check_generation_settings(facts, p, shard)
    kwargs = template_kwargs(config.generation.reasoning, tokenizer.chat_template or "", tok_path)  # or a config error
    key = _key(p, config, tokenizer_fingerprint(tok_path))
    done = facts.tokenized_done(shard)
    if done is not None and done.key == key and p["parquet"].exists():
        if sha256_file(p["parquet"]) == done["parquet_sha256"]:
            return TokenizeResult(**{**done["result"], "skipped": True})
    remove_marker(p["done"], config.run_dir)
    check_schema(p["prompts"], PROMPT_COLUMNS, "prompt shard (RUN/prompts)")
    mixed = "source" in pq.read_schema(p["prompts"]).names  # a data.mix run names each prompt's source
    table = pq.read_table(p["prompts"], columns=["id", "messages", *(["source"] if mixed else [])])
    messages = dict(zip(table.column("id").to_pylist(), table.column("messages").to_pylist()))
    records = read_records(p["generations"], log)
    vocab = target_vocab_size(tokenizer, tok_path, facts.model_dir())
    seen, chunk, chars, unfinished = set(), [], 0, deque()
    acc = _Acc(out=_Output(p["parquet"], vocab))
    if mixed:
        acc.sources = SourceTally(dict(zip(table.column("id").to_pylist(), table.column("source").to_pylist())))
    every = max(1, len(records) // TEMPLATE_CHECKS)
    try:
        with ThreadPoolExecutor(
            IN_FLIGHT, thread_name_prefix="encode"
        ) as executor:  # chunks k, k+1 encode while k+2 renders
            for k, record in enumerate(records + [None]):
                if record is None or len(chunk) == CHUNK or chars >= CHUNK_CHARS:
                    unfinished.append(_chunk(chunk, messages, tokenizer, vocab, config, acc, every, executor, kwargs))
                    chunk, chars = [], 0
                    while len(unfinished) > (IN_FLIGHT if record is not None else 0):
                        unfinished.popleft()()
                if record is None:
                    break
                if not isinstance(record, dict):
                    chunk.append((k, record, ("bad_record", f"record {k} is not a JSON object")))
                elif record.get("id") in seen:
                    chunk.append((k, record, ("duplicate", "a second record for this id")))
                else:
                    seen.add(record.get("id"))
                    chunk.append((k, record, None))
                    chars += _text_size(record)
        _save_outputs(p, acc)
    finally:
        acc.out.discard()
    result = TokenizeResult(
        shard,
        str(p["parquet"]),
        len(records),
        acc.kept,
        len(acc.rejected),
        acc.reasons,
        acc.tokens,
        acc.supervised,
        acc.truncated,
        acc.checks,
        False,
        acc.sources.counts,
    )
    assert result.in_ == result.ok + result.filtered, result
    write_marker(
        p["done"],
        STAGE,
        key,
        {"in": result.in_, "ok": result.ok, "filtered": result.filtered},
        parquet_sha256=sha256_file(p["parquet"]),
        tokenizer=tok_path,
        tokenizer_sha256=tok_hash,
        result={k: v for k, v in result.__dict__.items() if k != "skipped"},
    )
    log.info(
        "%s: %d records -> %d rows (%d tokens, %d supervised), %d filtered %s; template check %s",
        shard,
        result.in_,
        result.ok,
        result.tokens,
        result.supervised,
        result.filtered,
        result.reasons,
        acc.checks,
    )
    return result


def record(facts: RunFacts, results: list[TokenizeResult]) -> dict:
    """The stage's manifest entry: counts, reasons, token totals and the template check."""
    from eagle3.manifest import record_stage, versions
    from eagle3.results import StageCounts

    reasons: dict[str, int] = {}
    checks = {"checked": 0, "prompt_mismatch": 0, "full_mismatch": 0}
    for r in results:
        for k, n in r.reasons.items():
            reasons[k] = reasons.get(k, 0) + n
        for k, n in r.template_check.items():  # the fixed checks, and history_* on regenerated conversations
            if isinstance(n, int):
                checks[k] = checks.get(k, 0) + n
    counts = StageCounts(
        sum(r.in_ for r in results), sum(r.ok for r in results), 0, sum(r.filtered for r in results), reasons
    )
    rate = {
        k: round(checks[k] / checks["checked"], 4) if checks["checked"] else None
        for k in ("prompt_mismatch", "full_mismatch")
    }
    config = facts.config
    return record_stage(
        config.run_dir,
        STAGE,
        counts,
        status="ok",
        tokenizer=facts.tokenizer()[0],
        config_hash=section_hash(config.tokenize),
        tokens=sum(r.tokens for r in results),
        supervised_tokens=sum(r.supervised for r in results),
        truncated_rows=sum(r.truncated for r in results),
        template_check={**checks, "mismatch_rate": rate},
        **({"per_source": per_source} if (per_source := SourceTally.merge([r.per_source for r in results])) else {}),
        versions=versions("transformers", "tokenizers", "pyarrow"),
    )


def summary_line(entry: dict, run_dir: str | Path) -> str:
    """The CLI's end-of-run line for this stage."""
    where = Path(run_dir) / "tokenized"
    return f"tokenized:    {where}  (input_ids + loss_mask Parquet; filtered rows: shard-*.rejected.jsonl)"
