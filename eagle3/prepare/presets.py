"""Named dataset presets: where a widely used chat dataset lives and how its rows become conversations.

A preset is a schema, not a copy of the data. It names the hub id, the subset (hub config) and the
split, says which column holds the turns (or the single instruction), which keys hold a turn's role
and text and what the dataset's role names mean, and which rows to skip, each skip with a countable
kind. ``to_messages`` turns one raw row into the OpenAI form (``{"messages": [{role, content}]}``)
that ``eagle3.prepare.normalize`` already reads, or into a ``Rejected``; everything after that (turn
selection, empty content, length, ids, de-duplication) is the same code as for any other source.

Design choices:
- The rows can come from anywhere: the preset's hub id, another hub id with the same schema, or a
  local file or folder (an offline copy, or the small fixtures the tests use). So the mapping checks
  what it reads and rejects a row it cannot map (``missing_column``, ``bad_conversation``,
  ``unknown_role``) instead of trusting the hub's declared features.
- An unknown role rejects the row (``unknown_role``, naming it) rather than dropping the turn as some
  public converters do: a conversation with a turn cut out reads as a different conversation.
- Structural skips exist only where the data is known to need them. ShareGPT-style scrapes hold
  conversations that open with the assistant (the scrape started mid-chat) or repeat a role; many chat
  templates refuse both (they require user/assistant alternation), so such rows are skipped with
  ``leading_assistant`` / ``non_alternating`` before they fail at tokenization.

Where each fact comes from (read on the hub cards and in public converters, not guessed):
- sharegpt: SpecForge scripts/prepare_data.py loads ``Aeala/ShareGPT_Vicuna_unfiltered`` (split train),
  a parquet mirror of anon8231489123/ShareGPT_Vicuna_unfiltered (whose raw JSON files do not load with
  ``datasets``); rows ``{id, conversations: [{from, value}]}``; its role table maps human->user and
  gpt/chatgpt/bing/bard->assistant, system stays system.
- ultrachat: the HuggingFaceH4/ultrachat_200k card: subset ``default``, splits train_sft (208k rows),
  test_sft, train_gen, test_gen; columns prompt, prompt_id, messages list<{content, role}> with roles
  user/assistant (SpecForge reads ``messages`` of train_sft the same way).
- magpie: the Magpie-Align/Magpie-Llama-3.1-Pro-MT-300K-Filtered card (same family and columns as the
  single-turn Pro-300K-Filtered set): uuid, conversations list<{from, value}>, instruction, response,
  input_quality, llama_guard_2, ...; one split, train (300k rows). The roles are human/gpt
  (SpecForge reads Magpie-Qwen2.5-Pro-1M with its ShareGPT converter). Magpie's own filtering keeps
  rows by ``input_quality``; the preset skips the two lowest grades should a copy still hold them.
- openperfectblend: mlabonne/open-perfectblend (this project's default source; ~1.4M rows, parquet, split
  train): ShareGPT ``conversations`` [{from, value}] (SpecForge's ``perfectblend`` reads it with its
  ShareGPT converter).
- openthoughts (reasoning prompts): open-thoughts/OpenThoughts-114k, subsets ``default`` (114k rows,
  split train) and ``metadata``; ``default`` has columns system and conversations [{from, value}]
  (mlabonne/OpenThoughts-79k-filtered, a fixed copy, lists source, system, conversations). Its
  ``system`` column asks for the R1 distillation's thought-format tags, which is not how the target is
  served, so the preset reads only the conversation and the target thinks the way it does in
  production.
- opc (code instructions): SpecForge's ``opc`` loads OpenCoder-LLM/opc-sft-stage1 with a subset
  (largescale_diverse_instruct by default; also filtered_infinity_instruct, realuser_instruct), split
  train, columns instruction and output: one user turn per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3.prepare.normalize import Rejected

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"


@dataclass(frozen=True)
class SkipValues:
    """Skip a row whose ``column`` holds one of ``values`` (a row without the column is kept)."""

    kind: str
    column: str
    values: frozenset[str]


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str
    split: str
    about: str  # one line for docs and errors
    subset: str | None = None
    turns_column: str | None = "conversations"  # list of turns; None: instruction_column holds one user turn
    role_key: str = "from"
    text_key: str = "value"
    roles: Mapping[str, str] = field(default_factory=dict)  # dataset role -> system/user/assistant
    instruction_column: str | None = None
    alternating: bool = False  # skip rows that open with the assistant or repeat a role
    skip_values: tuple[SkipValues, ...] = ()

    def skips(self) -> list[str]:
        """The kinds of row this preset skips on purpose (beyond unreadable rows)."""
        kinds = ["leading_assistant", "non_alternating"] if self.alternating else []
        return kinds + [s.kind for s in self.skip_values]

    def to_messages(self, row: Any) -> dict | Rejected:
        """The row as ``{"messages": [...]}``, or why it is skipped."""
        if not isinstance(row, dict):
            return Rejected("not_an_object", f"row is a {type(row).__name__}, not an object (preset {self.name})")
        for skip in self.skip_values:
            value = row.get(skip.column)
            if isinstance(value, str) and value in skip.values:
                return Rejected(
                    skip.kind, f"{skip.column} is {value!r} (preset {self.name} skips {sorted(skip.values)})"
                )
        try:
            messages = self._instruction(row) if self.turns_column is None else self._turns(row)
        except Rejected as rej:
            return rej
        if self.alternating:
            problem = _alternation_problem(messages)
            if problem is not None:
                return problem
        return {"messages": messages}

    def _column(self, row: dict, name: str) -> Any:
        if name not in row:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise Rejected("missing_column", f"row has no column {name!r} (preset {self.name}); keys: {keys}")
        return row[name]

    def _instruction(self, row: dict) -> list[dict]:
        return [{"role": USER, "content": self._column(row, self.instruction_column)}]

    def _turns(self, row: dict) -> list[dict]:
        turns = self._column(row, self.turns_column)
        if not isinstance(turns, list):
            raise Rejected("bad_conversation", f"{self.turns_column!r} is {type(turns).__name__}, not a list")
        if not turns:
            raise Rejected("empty", f"{self.turns_column!r} has no turns")
        out = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict) or self.role_key not in turn or self.text_key not in turn:
                raise Rejected("bad_turn", f"turn {k} is not an object with {self.role_key!r} and {self.text_key!r}")
            role = self.roles.get(turn[self.role_key]) if isinstance(turn[self.role_key], str) else None
            if role is None:
                known = ", ".join(self.roles)
                raise Rejected(
                    "unknown_role", f"turn {k} has role {turn[self.role_key]!r}; preset {self.name} knows {known}"
                )
            out.append({"role": role, "content": turn[self.text_key]})
        return out


def _alternation_problem(messages: list[dict]) -> Rejected | None:
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[:1] == [SYSTEM] else roles
    if body[:1] == [ASSISTANT]:
        return Rejected("leading_assistant", "the conversation opens with an assistant turn")
    for k in range(1, len(body)):
        if body[k] == body[k - 1] or body[k] == SYSTEM:
            offset = len(roles) - len(body)
            return Rejected("non_alternating", f"turn {k + offset} ({body[k]}) follows a {body[k - 1]} turn")
    return None


_SHAREGPT_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "system": SYSTEM}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="sharegpt",
            hub_id="Aeala/ShareGPT_Vicuna_unfiltered",
            split="train",
            about="ShareGPT: conversations people shared from ChatGPT (the scrape Vicuna trained on)",
            roles={**_SHAREGPT_ROLES, "chatgpt": ASSISTANT, "bing": ASSISTANT, "bard": ASSISTANT},
            alternating=True,
        ),
        Preset(
            name="ultrachat",
            hub_id="HuggingFaceH4/ultrachat_200k",
            split="train_sft",
            about="UltraChat 200k, multi-turn synthetic dialogues (the SFT split, 208k rows)",
            turns_column="messages",
            role_key="role",
            text_key="content",
            roles={USER: USER, ASSISTANT: ASSISTANT, SYSTEM: SYSTEM},
        ),
        Preset(
            name="magpie",
            hub_id="Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered",
            split="train",
            about="Magpie: instructions Llama-3.1-70B-Instruct wrote itself, filtered (300k rows)",
            roles=_SHAREGPT_ROLES,
            skip_values=(SkipValues("poor_input_quality", "input_quality", frozenset({"very poor", "poor"})),),
        ),
        Preset(
            name="openperfectblend",
            hub_id="mlabonne/open-perfectblend",
            split="train",
            about="open-perfectblend, a mix of chat, math, code and instruction sets (~1.4M rows)",
            roles=_SHAREGPT_ROLES,
            alternating=True,
        ),
        Preset(
            name="openthoughts",
            hub_id="open-thoughts/OpenThoughts-114k",
            subset="default",
            split="train",
            about="OpenThoughts 114k reasoning problems: math, code, science, puzzles",
            roles=_SHAREGPT_ROLES,
        ),
        Preset(
            name="opc",
            hub_id="OpenCoder-LLM/opc-sft-stage1",
            subset="largescale_diverse_instruct",
            split="train",
            about="OpenCoder stage-1 SFT code instructions (one user turn per row)",
            turns_column=None,
            instruction_column="instruction",
        ),
    )
}


def known() -> str:
    return ", ".join(PRESETS)


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {known()}") from None
