"""One generation record -> the row tokenize writes: which prompt it answers, the server-ids
path (regenerated conversations included) and the check of the chat template against the
server's ids. The batched template path and the stage around it are in build.py and stage.py."""

from __future__ import annotations

from eagle3.generate.samples import prompt_of
from eagle3.tokenize.build import RowError, Sample, conversation, from_regenerated, from_server_ids, render_ids


def check_template(tokenizer, messages, record, sample: Sample, checks: dict, kwargs: dict) -> None:
    """Does the chat template reproduce the server's ids for this conversation?"""
    checks["checked"] += 1
    prompt = record["prompt_token_ids"]
    if render_ids(tokenizer, messages, add_generation_prompt=True, **kwargs) != prompt:
        checks["prompt_mismatch"] += 1
    full = render_ids(tokenizer, conversation(messages, record), **kwargs)
    if full[: len(sample.input_ids)] != sample.input_ids.tolist():
        checks["full_mismatch"] += 1


def messages_of(record: dict, messages: dict) -> list[dict]:
    """The prompt a record answers: its own context (a regenerated conversation carries the
    target's earlier answers), else its prompt's messages (by prompt_id for samples k > 0)."""
    rid = record.get("id")
    pid = record.get("prompt_id", rid)
    if not isinstance(rid, str) or not isinstance(pid, str) or pid not in messages:
        raise RowError("unknown_id", f"id {rid!r} (prompt {pid!r}) is not in the prompt shard")
    own = record.get("messages")
    if own is None:
        return messages[pid]
    if not isinstance(own, list) or not all(isinstance(m, dict) and "role" in m for m in own):
        raise RowError("bad_record", "messages is not a list of {role, content} objects")
    return own


def server_sample(record: dict, context: list[dict], tokenizer, vocab: int, checks: dict, check: bool, kw: dict):
    """A record with the server's ids; ``checks`` counts the template check and, for regenerated
    conversations, whether the earlier answers could be supervised."""
    if record.get("regenerated_turns", 1) > 1:  # the target's own earlier answers: supervised too
        sample, history = from_regenerated(record, context, tokenizer, vocab)
        name = "history_supervised" if history else "history_unsupervised"
        checks[name] = checks.get(name, 0) + 1
    else:
        sample = from_server_ids(record, vocab)
    if check:
        check_template(tokenizer, context, record, sample, checks, kw)
    return sample


class SourceTally:
    """Per source of a mixed run (the prompt shard's ``source`` column): rows in, kept, filtered,
    and the tokens kept. Empty when the shard has no such column (a single source)."""

    def __init__(self, source_of: dict[str, str] | None = None):
        self.source_of = source_of or {}
        self.counts: dict[str, dict[str, int]] = {}

    def add(self, record_id, kept: bool, tokens: int = 0, supervised: int = 0) -> None:
        if not self.source_of:
            return
        pid = prompt_of(record_id) if isinstance(record_id, str) else None
        name = self.source_of.get(pid, "unknown") if pid else "unknown"
        c = self.counts.setdefault(name, {"in": 0, "ok": 0, "filtered": 0, "tokens": 0, "supervised_tokens": 0})
        c["in"] += 1
        c["ok" if kept else "filtered"] += 1
        c["tokens"] += tokens
        c["supervised_tokens"] += supervised

    @staticmethod
    def merge(tallies: list[dict]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for tally in tallies:
            for name, c in tally.items():
                into = out.setdefault(name, dict.fromkeys(c, 0))
                for k, n in c.items():
                    into[k] = into.get(k, 0) + n
        return out
