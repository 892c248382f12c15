"""Turn one raw dataset row into prompts, or into a rejection with a reason.

Design choices:
- Two schemas are read: ShareGPT (``conversations: [{from, value}]``, roles human/gpt/system)
  and OpenAI (``messages: [{role, content}]``). Both become ``[{role, content}]`` with roles
  system/user/assistant.
- Content is normalised before hashing (CRLF -> LF, surrounding whitespace stripped) so
  the same prompt copied from two sources gets one id and is de-duplicated.
- The final assistant answer is dropped: the target regenerates it. Earlier assistant
  turns of a multi-turn conversation stay as context: chat templates expect alternating
  turns, later user turns refer to them, and they are never supervised (the loss mask
  covers only the regenerated answer).
- A row never vanishes: every problem raises ``Rejected`` with a kind (a stable label
  for counting) and a detail naming the turn.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from eagle3.errors import InputError

Turns = Literal["last_turn", "first_turn", "all_turns", "regenerate"]

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class Rejected(InputError):
    """A row (or one prompt of it) that cannot be used, with a countable kind."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def prompt_id(messages: tuple[tuple[str, str], ...]) -> str:
    """Stable id: a hash of the normalised prompt (roles and contents)."""
    text = json.dumps([list(m) for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _schema_fields(row: dict) -> tuple[str, list, str, str]:
    if "conversations" in row:
        return "conversations", row["conversations"], "from", "value"
    if "messages" in row:
        return "messages", row["messages"], "role", "content"
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise Rejected(
        "no_conversation", f"row has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {keys}"
    )


def _text_of(content: Any, where: str) -> str:
    """String content, or OpenAI content parts that are all text."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    ):
        return "".join(p["text"] for p in content)
    raise Rejected("non_string_content", f"{where} content is {type(content).__name__}, not a string")


def read_conversation(row: Any) -> list[tuple[str, str]]:
    """Normalise a row of either schema to (role, content) pairs."""
    if not isinstance(row, dict):
        raise Rejected("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
    field, turns, role_key, text_key = _schema_fields(row)
    if not isinstance(turns, list):
        raise Rejected("bad_conversation", f"'{field}' is {type(turns).__name__}, not a list")
    if not turns:
        raise Rejected("empty", f"'{field}' has no turns")
    out = []
    for k, turn in enumerate(turns):
        where = f"turn {k}"
        if not isinstance(turn, dict):
            raise Rejected("bad_turn", f"{where} is {type(turn).__name__}, not an object")
        if role_key not in turn or text_key not in turn:
            raise Rejected("bad_turn", f"{where} lacks '{role_key}' or '{text_key}'")
        role = ROLES.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise Rejected("unknown_role", f"{where} has role {turn[role_key]!r}; known: {', '.join(ROLES)}")
        text = _text_of(turn[text_key], where)
        out.append((role, text.replace("\r\n", "\n").strip()))
    return out


def _prefix_ends(conv: list[tuple[str, str]], turns: Turns) -> list[int]:
    users = [i for i, (role, _) in enumerate(conv) if role == "user"]
    if not users:
        raise Rejected("no_user_turn", "conversation has no user turn")
    if turns == "first_turn":
        return [users[0] + 1]
    if turns == "all_turns":
        return [i + 1 for i in users]
    return [users[-1] + 1]  # last_turn, and regenerate (generation replaces the dataset's answers)


def _check_prompt(messages: tuple[tuple[str, str], ...], max_chars: int) -> Prompt:
    for k, (role, text) in enumerate(messages):
        if not text:
            raise Rejected("empty_content", f"turn {k} ({role}) is empty")
    size = sum(len(text) for _, text in messages)
    if size > max_chars:
        raise Rejected("too_long", f"prompt has {size} characters > data.max_prompt_chars={max_chars}")
    return Prompt(prompt_id(messages), messages)


def candidates(row: Any, turns: Turns, max_chars: int) -> list[Prompt | Rejected]:
    """All prompts a row yields (one per user turn in all_turns mode), each checked on its own.

    A row that cannot be read at all yields a single ``Rejected``.
    """
    try:
        conv = read_conversation(row)
        ends = _prefix_ends(conv, turns)
    except Rejected as rej:
        return [rej]
    out: list[Prompt | Rejected] = []
    for end in ends:
        try:
            out.append(_check_prompt(tuple(conv[:end]), max_chars))
        except Rejected as rej:
            out.append(rej)
    return out
