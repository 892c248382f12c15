"""Where a user turn starts and ends in a model's own chat template (for self-written prompts).

Design choices:
- Nothing is hard-coded per model family. The template renders a conversation whose user
  message is a sentinel string no template contains; the text before the sentinel is the
  prefix a completion continues (system turn, default system prompt and user header
  included), and the text right after it, up to the next newline or up to the end of a
  special token that opens it, is the turn's end marker (ChatML ``<|im_end|>``, Llama 3
  ``<|eot_id|>``).
- Rendered with ``add_generation_prompt=False``: the text after the sentinel is then only
  the user turn's end, not the assistant header.
- A turn end that is one token of the vocabulary is also sent as a stop token id: vLLM
  matches stop *strings* on the detokenized text, which leaves special tokens out, so a
  special end-of-turn token would never match as a string.
- The prefix starts with the BOS token when the template writes one; requests send
  ``add_special_tokens: false`` so the server does not add a second.
- A template that cannot be cut (it rejects a system message, drops the content, or writes
  nothing after it) is a ``ConfigError`` naming the model, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.config import ConfigError

SENTINEL = "\u2063EAGLE3-USER-TURN-7f3a9c\u2063"


@dataclass(frozen=True)
class TurnPrefix:
    system: str | None  # the system prompt sent (None: none, the template's default applies)
    prefix: str  # template text up to where the user's words begin
    stop: str  # template text that ends the user turn
    stop_token_ids: tuple[int, ...]  # the stop as one token id, when it is one

    def messages(self, user: str) -> list[dict[str, str]]:
        """The prompt a kept request becomes: the same system message (if any) and the user turn."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*head, {"role": "user", "content": user}]


def _render(tokenizer, messages: list[dict], model: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # jinja raises its own errors (e.g. "System role not supported")
        roles = "+".join(m["role"] for m in messages)
        raise ConfigError(
            f"the chat template of {model} cannot render a {roles} conversation for data.source=self:prompts: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(text, str):
        raise ConfigError(f"the chat template of {model} rendered {type(text).__name__}, not text")
    return text


def _special_strings(tokenizer) -> list[str]:
    """Special and added token strings, longest first (so <|im_end|> wins over a shorter match)."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    found |= set((tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}).keys())
    return sorted((s for s in found if s), key=len, reverse=True)


def turn_end(tail: str, specials: list[str]) -> str:
    """The user turn's end marker: a special token opening ``tail``, else ``tail`` up to its first newline."""
    for token in specials:
        if tail.startswith(token):
            return token
    return tail.split("\n", 1)[0]


def _single_token(tokenizer, text: str) -> tuple[int, ...]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids[0],) if len(ids) == 1 else ()


def derive(tokenizer, system: str | None, model: str) -> TurnPrefix:
    """The prefix and end of a user turn in ``tokenizer``'s chat template, after ``system``
    (None: no system message)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"{model} has no chat template: data.source=self:prompts needs one to know where a user turn starts"
        )
    head = [{"role": "system", "content": system}] if system is not None else []
    text = _render(tokenizer, [*head, {"role": "user", "content": SENTINEL}], model)
    cut = text.find(SENTINEL)
    if cut < 0:
        raise ConfigError(
            f"the chat template of {model} does not write the user message into its text, so a user turn cannot "
            "be located for data.source=self:prompts"
        )
    stop = turn_end(text[cut + len(SENTINEL) :], _special_strings(tokenizer))
    if not stop.strip():
        raise ConfigError(
            f"the chat template of {model} writes nothing that ends a user turn right after the message (it "
            f"renders {text[cut + len(SENTINEL) :][:40]!r}); data.source=self:prompts cannot tell where a "
            "request ends"
        )
    return TurnPrefix(system, text[:cut], stop, _single_token(tokenizer, stop))


def derive_all(tokenizer, system_prompts: list[str], model: str) -> list[TurnPrefix]:
    """One prefix per configured system prompt ('' or an empty list: none, the template's default)."""
    systems = [s or None for s in system_prompts] or [None]
    return [derive(tokenizer, system, model) for system in systems]
