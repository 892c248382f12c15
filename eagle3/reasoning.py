"""Reasoning modes for the training text: ``generation.reasoning`` = keep | drop | disable.

A thinking target (Qwen3-style) writes reasoning, ``</think>``, then its answer. What the drafter
trains on decides which of those it learns to draft:

- **keep** (the default): train on reasoning and answer, the completion exactly as the target
  sampled it (server token ids). A deployment that serves a thinking model spends most of its
  tokens inside the reasoning, so that is where a drafter must be good.
- **drop**: train on the answer only. The target is asked as usual (it still thinks; nothing extra
  in the request), and tokenize builds the row from the chat template's rendering of the final
  assistant turn *without its reasoning*, which is how the template removes reasoning from a turn.
  For a deployment whose users switch thinking off per request (or whose traffic is mostly short
  answers), or to spend the token budget on answers.
- **disable**: ask the target not to think: every request carries
  ``chat_template_kwargs = {"enable_thinking": false}``, and the tokenize template path renders
  with the same switch, so prompt and answer are what the target reads and writes with thinking off.

**How drop builds a row, and why.** The server's ``completion_token_ids`` hold the reasoning, so
they cannot be used as they are. The row is ``prompt ids + completion ids`` where

- the prompt ids are the record's ``prompt_token_ids`` (exactly what the target read; a rendered
  prompt when the record has none): drop asked the target with the usual, thinking-on prompt;
- the completion is the text the template renders for the final turn with the reasoning removed
  (``{"role": "assistant", "content": answer}``), after the generation prompt and up to the end
  of the turn's ``{% generation %}`` span (to the end of the text for a template without markers,
  as the template path's prefix diff does), tokenized apart from the prompt, all of it supervised.

For the project's Qwen3-style tiny template (``eagle3/tiny/qwen3_chat_template.jinja``, whose
generation prompt already opens ``<think>\\n``) a final turn without reasoning renders as
``<think>\\n`` + ``\\n</think>\\n\\n`` + answer + ``<|im_end|>``: an empty think block, which is
what such a target emits when it does not reason. For Qwen3's own template (generation prompt
``<|im_start|>assistant\\n``) the supervised text is ``<think>\\n\\n</think>\\n\\n`` + answer: again
what the model writes when it skips thinking. So the drafter learns the target's no-reasoning
output, empty think block included, never a sequence the target would not produce.

Why the completion is tokenized apart from the prompt, not the whole conversation at once: vLLM
tokenizes the prompt text and the model then emits tokens after it; rendering the whole text at
once lets BPE merge across that boundary. Measured on the tiny tokenizer: the whole render gives
``<think>``, ``\\n\\n``, ``</think>``, while the served prompt ends ``<think>``, ``\\n`` and the
completion starts with its own ``\\n``. The answer is re-tokenized from the record's text, so its
ids can differ from the ones the target sampled (the same caveat as the template path; the
reasoning's end is not a token boundary that can be found in the ids of every model). A record
with no answer (cut by ``max_tokens`` inside its reasoning) has nothing to train on under drop and
is filtered as ``reasoning_only``. A record whose reasoning was not split off (no reasoning parser
ran) has it removed from its content as Qwen3's template does for earlier turns: the text after
the last ``</think>``.

**What a template can express** (``check_mode``; the rules read the template's code with its
``{# comments #}`` removed, since a comment saying "reasoning" renders nothing):

- keep: every template.
- drop: the template renders reasoning: it reads a reasoning field of a message
  (``reasoning_content``, ``reasoning`` or ``thinking``, the names transformers passes to templates
  for one) or handles a ``</think>`` tag. A template with neither never shows reasoning, so there
  is nothing to drop and the setting would silently do nothing (most often a config naming the
  wrong model): a config error.
- disable: the template reads an ``enable_thinking`` variable (Qwen3 and its derivatives). Other
  switches are not recognised (DeepSeek-V3.1's ``thinking`` defaults to off already; gpt-oss's
  ``reasoning_effort`` lowers reasoning but never turns it off): a config error, so a run never
  believes it asked for no reasoning when the template ignored the request.

The error is a ``ReasoningModeError`` naming ``generation.reasoning``, the mode and the template.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

from eagle3.config.base import ConfigError
from eagle3.errors import InputError

Mode = Literal["keep", "drop", "disable"]
MODES: tuple[str, ...] = ("keep", "drop", "disable")
KEY = "generation.reasoning"
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # transformers' aliases for one field
THINK_END = "</think>"
SWITCH = "enable_thinking"

_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)
_FIELD = re.compile(
    r"\.\s*(?:%s)\b|\[\s*['\"](?:%s)['\"]\s*\]" % ("|".join(REASONING_FIELDS), "|".join(REASONING_FIELDS))
)
_SWITCH = re.compile(rf"\b{SWITCH}\b")


class ReasoningModeError(InputError, ConfigError):
    """``generation.reasoning`` asks for a mode the target's chat template cannot express."""


@functools.lru_cache(maxsize=16)
def _code(template_text: str) -> str:
    return _COMMENT.sub("", template_text or "")


def renders_reasoning(template_text: str) -> bool:
    """Whether the template shows a message's reasoning (a reasoning field or a ``</think>`` tag)."""
    code = _code(template_text)
    return bool(_FIELD.search(code)) or THINK_END in code


def has_thinking_switch(template_text: str) -> bool:
    """Whether the template reads ``enable_thinking`` (the switch disable sets to false)."""
    return bool(_SWITCH.search(_code(template_text)))


def check_mode(mode: str, template_text: str, template_name: str) -> None:
    """Raise ReasoningModeError when ``template_text`` cannot express ``mode`` (rules: module doc)."""
    if mode not in MODES:
        raise ReasoningModeError(f"{KEY} = {mode!r}: not one of {', '.join(MODES)}")
    if mode == "keep":
        return
    where = f"{KEY} = {mode!r}: the chat template of {template_name}"
    if not (template_text or "").strip():
        raise ReasoningModeError(f"{where} is missing (the model folder ships none); use {KEY} = 'keep'")
    if mode == "drop" and not renders_reasoning(template_text):
        raise ReasoningModeError(
            f"{where} never renders reasoning (it reads no {'/'.join(REASONING_FIELDS)} field and no "
            f"{THINK_END} tag), so there is no reasoning to drop; use {KEY} = 'keep' for a target that does not think"
        )
    if mode == "disable" and not has_thinking_switch(template_text):
        also = " (or 'drop' to train on answers only)" if renders_reasoning(template_text) else ""
        raise ReasoningModeError(
            f"{where} has no {SWITCH} switch, so the target cannot be asked not to think; use {KEY} = 'keep'{also}"
        )


def template_kwargs(mode: str, template_text: str, template_name: str = "the target") -> dict:
    """Extra variables for rendering the chat template in this mode (tokenize's template path,
    the template check): ``{"enable_thinking": False}`` for disable, else none."""
    check_mode(mode, template_text, template_name)
    return {SWITCH: False} if mode == "disable" else {}


def request_extras(mode: str, template_text: str, template_name: str = "the target") -> dict:
    """Extra fields of a chat-completion request body in this mode: for disable
    ``{"chat_template_kwargs": {"enable_thinking": False}}``; ``{}`` for keep and drop (drop asks
    as keep does and removes the reasoning at tokenize). Raises ReasoningModeError like check_mode."""
    kwargs = template_kwargs(mode, template_text, template_name)
    return {"chat_template_kwargs": kwargs} if kwargs else {}


def strip_reasoning(content: str) -> str:
    """The answer of a content that still holds its reasoning (no reasoning parser ran): the text
    after the last ``</think>``, as Qwen3-style templates cut it for earlier turns."""
    return content.split(THINK_END)[-1] if THINK_END in content else content


def key_parts(mode: str) -> list[str]:
    """What the mode adds to the tokenize marker's key: nothing for keep (markers written before
    the mode existed stay valid), the mode otherwise."""
    return [] if mode == "keep" else [f"reasoning={mode}"]


def template_sources(config) -> list[str]:
    """The model specs whose chat templates this run renders: the tokenizer's (tokenize), and the
    served model's when the pipeline starts the server itself (generation renders with it)."""
    specs = [config.tokenize.tokenizer or config.server.model]
    if config.server.mode == "managed":
        specs.append(config.server.model)
    return list(dict.fromkeys(specs))


def _named(spec: str, folder: str) -> str:
    return spec if folder == spec else f"{spec} ({folder})"


def served_template(config) -> tuple[str, str]:
    """(text, name) of the chat template the target's server renders requests with: the served
    model's in managed mode; in external mode the local copy tokenize reads (tokenize.tokenizer,
    else server.model). A ``--chat-template`` in server.args is not read."""
    from eagle3.models import chat_template_text, resolve_model

    server = config.server
    spec = server.model if server.mode == "managed" else (config.tokenize.tokenizer or server.model)
    folder = resolve_model(spec)
    return chat_template_text(folder), _named(spec, folder)


def request_extras_for(config) -> dict:
    """request_extras for this config's mode and the served template (no model read for keep)."""
    mode = config.generation.reasoning
    return {} if mode == "keep" else request_extras(mode, *served_template(config))


def check_config(config) -> None:
    """check_mode for every chat template this config renders (resolves each model to its folder;
    nothing to read for keep)."""
    mode = config.generation.reasoning
    if mode == "keep":
        return
    from eagle3.models import chat_template_text, resolve_model

    for spec in template_sources(config):
        folder = resolve_model(spec)
        check_mode(mode, chat_template_text(folder), _named(spec, folder))
