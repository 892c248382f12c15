"""On-policy multi-turn regeneration (``data.turns = "regenerate"``): the target answers every user
turn of a conversation in order, each with its own earlier answers in its context.

Files (beside the shard's usual streams, ``RUN/generations/``):
- ``shard-K.turns.jsonl``: one record per finished turn *before* the last (id ``SAMPLE~tN``), flushed
  before the next turn is sent. This is the conversation's resume state.
- ``shard-K.jsonl`` (the ok stream): one record per conversation sample, id = the sample id: the
  last turn's result, with ``messages`` = the context it was asked in (system, user 1, the target's
  answer 1, ..., user N) and ``regenerated_turns``. Tokenize supervises every assistant turn of it.
- failed / filtered streams as for single prompts, with ``turn`` and ``turns``.

Design choices:
- A conversation is rebuilt from disk on resume: its finished turns are read back from the turns
  stream and the next unanswered turn is sent with exactly the context an uninterrupted run would
  have sent (the same records, the same order). Finished turns are never asked again.
- The dataset's assistant turns are dropped: only its system and user turns are used.
- A permanent failure (or, with keep_truncated off, a truncated answer) at turn k > 1 ends the
  conversation after turn k-1 when generation.partial_conversations = "keep": the ok record is then
  turn k-1's record with ``shortened`` = {at_turn, reason}. With "drop" the conversation is failed
  (or filtered, for truncation) with the turn named. A transient failure leaves the conversation
  open: the shard is incomplete and the next pass resumes at that turn.
- Earlier answers go back into the context as assistant messages with ``content`` and, when the
  server split it off, ``reasoning_content``: the chat template decides how history reasoning is
  rendered (Qwen3's drops it before the last user turn), exactly as at serving time.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from eagle3.generate.samples import SEP
from eagle3.records import RecordFileError, iter_records, read_records

TURN = "t"


def turn_id(sample: str, turn: int) -> str:
    return f"{sample}{SEP}{TURN}{turn}"


def turns_path(ok_path: Path) -> Path:
    return ok_path.with_name(ok_path.name[: -len(".jsonl")] + ".turns.jsonl")


def split_turns(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(leading system messages, user messages) of a prompt; the dataset's answers are dropped."""
    system = []
    for m in messages:
        if m["role"] != "system":
            break
        system.append({"role": "system", "content": m["content"]})
    users = [{"role": "user", "content": m["content"]} for m in messages if m["role"] == "user"]
    return system, users


def answer_message(record: dict) -> dict:
    """An earlier turn's answer as the assistant message the next turn's context holds."""
    out = {"role": "assistant", "content": record.get("content") or ""}
    if record.get("reasoning"):
        out["reasoning_content"] = record["reasoning"]
    return out


def context(messages: list[dict], finished: list[dict]) -> list[dict]:
    """The messages turn len(finished) + 1 is asked with: system, then user/answer pairs, then the next user."""
    system, users = split_turns(messages)
    out = list(system)
    for k, user in enumerate(users[: len(finished) + 1]):
        out.append(user)
        if k < len(finished):
            out.append(answer_message(finished[k]))
    return out


def num_turns(messages: list[dict]) -> int:
    return len(split_turns(messages)[1])


def finished_turns(path: Path, log=None) -> dict[str, list[dict]]:
    """Per sample id, its finished turn records 1..k in order (as the turns stream holds them).

    A gap (turn 3 without turn 2) cannot come from this code, which writes turns in order under the
    shard lock; it is damage and stops the shard naming the file and the sample."""
    by_sample: dict[str, dict[int, dict]] = defaultdict(dict)
    for k, rec in enumerate(read_records(path, log), start=1):
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("sample_id"), str)
            or not isinstance(rec.get("turn"), int)
        ):
            raise RecordFileError(f"{path}: record {k} lacks sample_id or turn; not a turns stream (file damaged)")
        by_sample[rec["sample_id"]].setdefault(rec["turn"], rec)
    out = {}
    for sid, turns in by_sample.items():
        ordered = [turns[k] for k in sorted(turns)]
        if sorted(turns) != list(range(1, len(turns) + 1)):
            raise RecordFileError(f"{path}: sample {sid} has turns {sorted(turns)}, not 1..{len(turns)} (file damaged)")
        out[sid] = ordered
    return out


def final_record(last: dict, sample, messages_sent: list[dict], regenerated: int) -> dict:
    """The conversation's ok record: the last turn's result, the context it was asked in."""
    keep = {k: v for k, v in last.items() if k not in ("id", "sample_id", "turn")}
    return {
        **keep,
        "id": sample.id,
        "prompt_id": sample.prompt_id,
        "messages": messages_sent,
        "regenerated_turns": regenerated,
    }


async def run_conversation(run, sample, rng) -> None:
    """Answer the sample's remaining turns in order; ``run`` is the shard's _Run (streams, stats, policy)."""
    gen = run.gen
    finished = list(run.turns_done.get(sample.id, []))
    n = num_turns(sample.messages)
    while len(finished) < n:
        t = len(finished) + 1
        ctx = context(sample.messages, finished)
        result, failure, attempts, latency = await run.ask(ctx, sample.sampling, rng)
        if failure is not None:
            if failure.transient or t == 1 or gen.partial_conversations == "drop":
                await run.fail(sample, failure, attempts, turn=t, turns=n)
            else:
                await _shortened(run, sample, finished, t, failure.kind)
            return
        run.stats.completion_tokens += len(result["completion_token_ids"] or [])
        record = {
            "id": turn_id(sample.id, t),
            "sample_id": sample.id,
            "turn": t,
            "turns": n,
            **result,
            "sampling": sample.sampling,
            "attempts": attempts,
            "latency_s": round(latency, 3),
        }
        truncated = result["finish_reason"] == "length" and not gen.keep_truncated
        if truncated and t < n and t > 1 and gen.partial_conversations == "keep":
            await _shortened(run, sample, finished, t, "truncated")
            return
        if truncated:
            why = f"truncated at turn {t} of {n}: finish_reason=length and generation.keep_truncated=false"
            await run.filtered(sample, {**final_record(record, sample, ctx, t), "reason": why})
            return
        if t == n:
            await run.ok(sample, final_record(record, sample, ctx, t))
            return
        await run.write("turns", record)  # on disk before the next turn is sent
        run.stats.turns += 1
        finished.append(record)


async def _shortened(run, sample, finished: list[dict], at_turn: int, reason: str) -> None:
    last = finished[-1]
    ctx = context(sample.messages, finished[:-1])
    record = final_record(last, sample, ctx, len(finished))
    record["shortened"] = {"at_turn": at_turn, "of": num_turns(sample.messages), "reason": reason}
    await run.ok(sample, record)
    run.stats.shortened += 1
    run.shortened[sample.id] = reason


def shortened_on_disk(ok_path: Path) -> dict[str, str]:
    """Sample id -> reason, for the conversations of an ok stream that ended early."""
    return {
        r["id"]: r["shortened"]["reason"]
        for r in iter_records(ok_path)
        if isinstance(r, dict) and isinstance(r.get("shortened"), dict)
    }
