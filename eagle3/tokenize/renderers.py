"""Plain-Python renderers for this project's own chat templates, checked against jinja.

Rendering a conversation through the sandboxed jinja chat template costs ~60-70 us (attribute
and call checks on every access), a quarter of the template path's time on short rows and CPU
that the batched Rust encode needs on a small machine. For the templates this project ships
(``eagle3/tiny/*_chat_template.jinja``: the demo's targets) the same text and generation spans
come from a few string operations instead.

Scope, so that "the same" is easy to keep true:
- a renderer is registered by the sha256 of the exact template text; an edited template (or any
  other model's) has no renderer and renders through jinja as before;
- a renderer handles only the plain shape the pipeline makes (dict messages with string
  ``role``/``content`` and an optional string ``reasoning_content``; roles system, user and
  assistant) and returns None for anything else (tool turns, content parts, other keys), which
  then renders through jinja;
- ``check_rows`` picks rows to render through jinja as well (the first of every batch and every
  ``CHECK_EVERY``-th one); any difference in text or spans raises ``RenderMismatch`` and the
  stage stops: a renderer that drifts from its template is a bug, never a quiet change of ids.
  tests/unit/test_tokenize_fast_paths.py compares every renderer with jinja on many varied conversations.
"""

from __future__ import annotations

import hashlib
from typing import Callable

from eagle3.errors import PermanentError

CHECK_EVERY = 64

Rendered = tuple[str, list[tuple[int, int]]]

_KEYS = frozenset(("role", "content", "reasoning_content"))


class RenderMismatch(PermanentError, RuntimeError):
    """A plain-Python renderer disagreed with its jinja template."""


def _plain(messages, roles) -> bool:
    for m in messages:
        if type(m) is not dict or not _KEYS.issuperset(m) or type(m.get("role")) is not str or m["role"] not in roles:
            return False
        if type(m.get("content")) is not str or type(m.get("reasoning_content", "")) is not str:
            return False
    return True


def _qwen3(messages: list[dict], specials: dict) -> Rendered | None:
    """eagle3/tiny/qwen3_chat_template.jinja with enable_thinking undefined (thinking on),
    add_generation_prompt false."""
    if not _plain(messages, ("system", "user", "assistant")):
        return None
    last_user = -1
    for k, m in enumerate(messages):
        if m["role"] == "user":
            last_user = k
    parts: list[str] = []
    size = 0
    spans: list[tuple[int, int]] = []
    for k, m in enumerate(messages):
        content = m["content"]
        if m["role"] != "assistant":
            piece = "<|im_start|>" + m["role"] + "\n" + content + "<|im_end|>\n"
            parts.append(piece)
            size += len(piece)
            continue
        if "reasoning_content" in m:
            reasoning = m["reasoning_content"]
        elif "</think>" in content:
            reasoning = content.split("</think>")[0].split("<think>")[-1]
            content = content.split("</think>")[-1]
        else:
            reasoning = ""
        head = "<|im_start|>assistant\n<think>\n" if k > last_user else "<|im_start|>assistant\n"
        body = (reasoning.strip("\n") + "\n</think>\n\n" if k > last_user else "") + content.lstrip("\n") + "<|im_end|>"
        start = size + len(head)
        spans.append((start, start + len(body)))
        parts += (head, body, "\n")
        size = start + len(body) + 1
    return "".join(parts), spans


def _llama3(messages: list[dict], specials: dict) -> Rendered | None:
    """eagle3/tiny/llama3_chat_template.jinja, add_generation_prompt false (reasoning dropped)."""
    bos = specials.get("bos_token", "")
    if type(bos) is not str or not _plain(messages, ("system", "user", "assistant")):
        return None
    parts, size, spans = [bos], len(bos), []
    for m in messages:
        head = "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n"
        body = m["content"].strip() + "<|eot_id|>"
        if m["role"] == "assistant":
            spans.append((size + len(head), size + len(head) + len(body)))
        parts += (head, body)
        size += len(head) + len(body)
    return "".join(parts), spans


RENDERERS: dict[str, Callable[[list[dict], dict], Rendered | None]] = {
    # eagle3/tiny/qwen3_chat_template.jinja
    "2d07cca404e406454b3bf0169c523b3d6790827c8e2d1e15b9a54add7c25d90d": _qwen3,
    # eagle3/tiny/llama3_chat_template.jinja
    "e76ac3fe8032754b214dcaacd312165a61a8eb618cd2717808e7e559f5ad26ee": _llama3,
}


def renderer_for(template: str) -> Callable[[list[dict], dict], Rendered | None] | None:
    return RENDERERS.get(hashlib.sha256(template.encode()).hexdigest())


def check_rows(n: int) -> range:
    """Rows of a batch of ``n`` that are also rendered through jinja and compared."""
    return range(0, n, CHECK_EVERY)


def mismatch(index: int, fast: Rendered, slow: Rendered) -> RenderMismatch:
    (a, sa), (b, sb) = fast, slow
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    what = (
        f"text differs at char {at}: {a[at : at + 40]!r} vs jinja {b[at : at + 40]!r}"
        if a != b
        else f"spans {sa} vs jinja {sb}"
    )
    return RenderMismatch(
        f"the plain-Python renderer for this chat template disagrees with jinja on conversation {index} of the "
        f"batch: {what}. This is a bug in eagle3/tokenize/renderers.py; remove the template's entry from "
        "RENDERERS to render through jinja"
    )
