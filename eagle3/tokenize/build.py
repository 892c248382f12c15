"""Token ids and loss masks for one sample, built together in one pass.

Two paths:
- **server ids** (default whenever a generation record carries them): ``input_ids =
  prompt_token_ids + completion_token_ids`` exactly as the target saw and produced them,
  ``loss_mask`` 0 on the prompt and 1 on the completion (reasoning, ``</think>``, answer and
  the end-of-turn token vLLM includes in ``token_ids``). No re-tokenization can drift from
  what the drafter will meet when serving.
- **template** (records without ids, or existing conversations): the tokenizer's chat
  template renders the conversation. Where the template marks assistant text with
  ``{% generation %}``, ``return_assistant_tokens_mask`` gives the mask; otherwise the mask
  comes from rendering growing prefixes and diffing: the tokens an assistant turn adds
  after its generation prompt are its supervised tokens. A template whose prefixes are not
  prefixes of the whole (rare) is reported per row, not guessed.

Speed of the batched template path (benchmarks/bench_tokenize.py), both with checks that stop the
run on any difference: the project's own templates render in plain Python instead of sandboxed
jinja (renderers.py), and for byte-level BPE tokenizers the masks of ASCII rows come from token
byte lengths, which lets the encode skip character-offset tracking (offset_free.py).

Where reasoning goes: templates like Qwen3's render an assistant turn's reasoning only for
turns after the last user message; earlier turns lose it. So in a multi-turn conversation
only the final answer's reasoning is supervised, which matches what the target sees at
serving time (vLLM renders the same template). ``generation.reasoning`` changes that
(eagle3/reasoning.py): drop builds the row from the answer alone (``answer_only``), disable
renders the template with ``enable_thinking=False``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from eagle3.errors import InputError
from eagle3.reasoning import strip_reasoning
from eagle3.tokenize import offset_free, renderers

FAST_RENDER = True  # False: every row through jinja (benchmarks/bench_tokenize.py measures both)
OFFSET_FREE = True  # False: every template-path row encoded with character offsets
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class RowError(InputError, ValueError):
    """A row that cannot be tokenized, with a countable kind."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8
    path: str  # "server_ids" | "template"

    @classmethod
    def of(cls, ids, mask, path: str) -> Sample:
        return cls(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), path)


def _int_list(value, field: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RowError("bad_record", f"{field} is not a list of integers")
    if value and (min(value) < 0 or max(value) >= vocab_size):
        raise RowError("bad_record", f"{field} holds ids outside the tokenizer's vocabulary [0, {vocab_size})")
    return value


def from_server_ids(record: dict, vocab_size: int) -> Sample:
    prompt = _int_list(record.get("prompt_token_ids"), "prompt_token_ids", vocab_size)
    completion = _int_list(record.get("completion_token_ids"), "completion_token_ids", vocab_size)
    if not completion:
        raise RowError("empty_completion", "the completion has no tokens")
    mask = np.zeros(len(prompt) + len(completion), dtype=np.uint8)
    mask[len(prompt) :] = 1
    return Sample(np.asarray(prompt + completion, dtype=np.int32), mask, "server_ids")


def has_ids(record: dict) -> bool:
    return record.get("prompt_token_ids") is not None and record.get("completion_token_ids") is not None


def conversation(messages: list[dict], record: dict, mode: str = "keep") -> list[dict]:
    """The prompt plus the regenerated answer as an assistant turn (reasoning kept apart; with
    ``mode`` "drop", left out)."""
    content, reasoning = record.get("content"), record.get("reasoning")
    if not isinstance(content, (str, type(None))) or not isinstance(reasoning, (str, type(None))):
        raise RowError("bad_record", "content and reasoning must be strings or null")
    if not content and not reasoning:
        raise RowError("empty_completion", "the record has neither content nor reasoning")
    if mode == "drop":
        answer = strip_reasoning(content or "")
        if not answer.strip():
            raise RowError(
                "reasoning_only", "generation.reasoning = 'drop' and the record has no answer, only reasoning"
            )
        return [*messages, {"role": "assistant", "content": answer}]
    turn = {"role": "assistant", "content": content or ""}
    if reasoning:
        turn["reasoning_content"] = reasoning
    return [*messages, turn]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def render_ids(tokenizer, messages, **kwargs) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, tokenize=True, **kwargs))


def answer_only(tokenizer, messages: list[dict], record: dict, vocab_size: int) -> Sample:
    """generation.reasoning = drop: the prompt (the record's ``prompt_token_ids``, else rendered),
    then the template's rendering of the final turn without its reasoning, from the end of the
    generation prompt to the end of the turn's generation span (the text's end without markers),
    tokenized apart from the prompt and supervised whole. eagle3/reasoning.py says why."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = tokenizer.chat_template or ""
    whole = conversation(messages, record, "drop")
    specials, markers = tokenizer.special_tokens_map, bool(GENERATION_TAG.search(template))
    try:
        (prompt,), _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **specials)
        (text,), (spans,) = render_jinja_template(
            [whole], chat_template=template, return_assistant_tokens_mask=markers, **specials
        )
    except Exception as exc:  # jinja raise_exception, unknown roles ...: the row, not the run
        raise RowError("template_error", f"{type(exc).__name__}: {exc}") from exc
    end = spans[-1][1] if markers and spans else len(text)
    if not text.startswith(prompt) or end <= len(prompt):
        raise RowError(
            "template_not_prefix_stable", "the answer without its reasoning does not render after the generation prompt"
        )
    prompt_ids = record.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    prompt_ids = _int_list(prompt_ids, "prompt_token_ids", vocab_size)
    completion = tokenizer.encode(text[len(prompt) : end], add_special_tokens=False)
    return Sample.of(prompt_ids + completion, [0] * len(prompt_ids) + [1] * len(completion), "answer_only")


def from_template(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> Sample:
    """Render a whole conversation; every assistant turn the template renders is supervised."""
    kwargs = template_kwargs or {}
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
        return Sample.of(out["input_ids"], out["assistant_masks"], "template")
    return _by_prefix_diff(tokenizer, messages, kwargs)


def _span_mask(offsets, spans) -> np.ndarray:
    """1 on every token that overlaps a generation span (character ranges of the render)."""
    pos = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(pos), dtype=bool)
    for start, end in spans:
        mask |= (pos[:, 1] > start) & (pos[:, 0] < end)
    return mask.astype(np.uint8)


def _encoding_mask(encoding, spans) -> np.ndarray:
    """The span mask from the encoding's char->token map: two look-ups per span instead of
    converting every token's offsets; the full offset scan only when a span edge maps to no token."""
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for start, end in spans:
        if end <= start:
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:
            return _span_mask(encoding.offsets, spans)
        mask[first : last + 1] = 1
    return mask


def from_template_batch(tokenizer, conversations: list[list[dict]], executor=None, template_kwargs: dict | None = None):
    """Many conversations at once: one render pass and one batched (parallel, Rust) encode.

    The masks come from the template's generation spans mapped onto token offsets with numpy
    (what ``return_assistant_tokens_mask`` computes, without its per-token Python loop). Falls
    back to one at a time for templates without generation markers, and for a batch that fails
    as a whole, so one bad conversation is reported alone.

    With an ``executor`` the encode runs there and a function that returns the samples comes
    back at once: the tokenizer's Rust encode releases the GIL, so the caller can render the
    next batch meanwhile (measured: the encode alone keeps only ~1.2 of 2 cores busy).

    ``template_kwargs`` are extra template variables (generation.reasoning = disable:
    ``enable_thinking=False``); with any, every row renders through jinja."""
    kwargs = template_kwargs or {}
    rendered = _render_generation(tokenizer, conversations, kwargs) if conversations else None
    if rendered is None:
        samples = [_safe_template(tokenizer, c, kwargs) for c in conversations]
        return (lambda: samples) if executor is not None else samples
    texts, spans = rendered
    # The Rust tokenizer directly: transformers' per-row conversion of ids, offsets and
    # masks into Python lists cost as much as the encoding itself (measured). Rows whose mask
    # can come from the ids alone skip offset tracking (eagle3/tokenize/offset_free.py); the
    # others, and a sample of those as a check, are encoded with offsets.
    backend = tokenizer.backend_tokenizer
    table = offset_free.byte_lengths(backend) if OFFSET_FREE else None
    quick = [k for k, text in enumerate(texts) if text.isascii()] if table is not None else []
    checked = [quick[j] for j in range(0, len(quick), offset_free.CHECK_EVERY)]
    slow = sorted(set(range(len(texts))) - set(quick)) + checked if quick else list(range(len(texts)))

    def encode():
        return (
            backend.encode_batch_fast([texts[k] for k in quick], add_special_tokens=False) if quick else [],
            backend.encode_batch([texts[k] for k in slow], add_special_tokens=False) if slow else [],
        )

    if executor is None:
        return _assemble(backend, table, texts, spans, quick, slow, *encode())
    future = executor.submit(encode)
    return lambda: _assemble(backend, table, texts, spans, quick, slow, *future.result())


def _assemble(backend, table, texts, spans, quick, slow, fast_encodings, offset_encodings) -> list[Sample]:
    out: list[Sample | None] = [None] * len(texts)
    for k, encoding in zip(slow, offset_encodings):
        out[k] = Sample(np.array(encoding.ids, dtype=np.int32), _encoding_mask(encoding, spans[k]), "template")
    ids = [np.array(e.ids, dtype=np.int32) for e in fast_encodings]
    masks = offset_free.masks(table, ids, [texts[k] for k in quick], [spans[k] for k in quick]) if quick else []
    missing = []
    for k, row_ids, mask in zip(quick, ids, masks):
        if mask is None:
            if out[k] is None:
                missing.append(k)
        elif out[k] is None:
            out[k] = Sample(row_ids, mask, "template")
        elif not (np.array_equal(out[k].input_ids, row_ids) and np.array_equal(out[k].loss_mask, mask)):
            raise offset_free.MaskMismatch(
                f"conversation {k} of the batch: ids or mask from token lengths differ from the tokenizer's "
                "offsets (a bug in eagle3/tokenize/offset_free.py; set eagle3.tokenize.build.OFFSET_FREE = "
                "False to use offsets only)"
            )
    for k, encoding in zip(
        missing, backend.encode_batch([texts[k] for k in missing], add_special_tokens=False) if missing else []
    ):
        out[k] = Sample(np.array(encoding.ids, dtype=np.int32), _encoding_mask(encoding, spans[k]), "template")
    return out


def _render_generation(tokenizer, conversations: list[list[dict]], kwargs: dict):
    """(texts, generation spans) for templates with generation markers; None when the
    template has none or some row does not render (found row by row by the caller).

    The project's own templates render in plain Python (eagle3/tokenize/renderers.py), with a
    sample of rows rendered through jinja too and compared (a difference stops the run); other
    templates, conversations outside the renderer's plain shape, and renders with extra template
    variables (the renderers know only the defaults), go through jinja."""
    template = tokenizer.chat_template or ""
    if not GENERATION_TAG.search(template):
        return None
    specials = tokenizer.special_tokens_map
    fast = renderers.renderer_for(template) if FAST_RENDER and not kwargs else None
    out = [fast(c, specials) for c in conversations] if fast is not None else [None] * len(conversations)
    checked = [k for k in renderers.check_rows(len(conversations)) if out[k] is not None]
    todo = [k for k, r in enumerate(out) if r is None] + checked
    if todo:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template(
                [conversations[k] for k in todo],
                chat_template=template,
                return_assistant_tokens_mask=True,
                **specials,
                **kwargs,
            )
        except Exception:  # a template error on one row: found row by row
            return None
        for k, text, sp in zip(todo, texts, spans):
            if out[k] is None:
                out[k] = (text, sp)
            elif out[k] != (text, sp):
                raise renderers.mismatch(k, out[k], (text, sp))
    return [t for t, _ in out], [s for _, s in out]


def _safe_template(tokenizer, conv: list[dict], kwargs: dict) -> Sample | RowError:
    try:
        return from_template(tokenizer, conv, kwargs)
    except RowError as err:
        return err
    except Exception as exc:  # jinja raise_exception, unknown roles ...: the row, not the run
        return RowError("template_error", f"{type(exc).__name__}: {exc}")


def _by_prefix_diff(tokenizer, messages: list[dict], kwargs: dict) -> Sample:
    ids = render_ids(tokenizer, messages, **kwargs)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_ids(tokenizer, messages[:k], add_generation_prompt=True, **kwargs)
        upto = render_ids(tokenizer, messages[: k + 1], **kwargs)
        if ids[: len(upto)] != upto or upto[: len(before)] != before:
            raise RowError(
                "template_not_prefix_stable", f"rendering turn {k} is not a prefix of the whole conversation"
            )
        mask[len(before) : len(upto)] = 1
    return Sample.of(ids, mask, "template")


def _strip_reasoning(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "reasoning_content"}


def history_mask(
    tokenizer, context: list[dict], prompt_ids: list[int], kwargs: dict | None = None
) -> np.ndarray | None:
    """1 on every earlier assistant turn of ``context`` (the target's own answers, on-policy
    multi-turn) inside the server's ``prompt_ids``, 0 elsewhere; None when the template's pieces
    do not line up with those ids (the caller then supervises the last answer only, and counts it).

    With generation markers the template marks the spans itself. Otherwise each turn's span is
    found by rendering the prefixes around it (as ``_by_prefix_diff``); a template that renders a
    turn's reasoning only while it is the last turn (Qwen3's) is tried again with that reasoning
    removed, which is how the template renders it once a later user turn follows. Every span is
    checked against the server's ids, so a guess that is wrong is never used."""
    kwargs = kwargs or {}
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        out = tokenizer.apply_chat_template(
            context,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=True,
            **kwargs,
        )
        if list(out["input_ids"]) != list(prompt_ids):
            return None
        return np.asarray(out["assistant_masks"], dtype=np.uint8)
    mask = np.zeros(len(prompt_ids), dtype=np.uint8)
    for k, message in enumerate(context):
        if message["role"] != "assistant":
            continue
        before = render_ids(tokenizer, context[:k], add_generation_prompt=True, **kwargs)
        for candidate in (message, _strip_reasoning(message)):
            upto = render_ids(tokenizer, [*context[:k], candidate], **kwargs)
            if list(prompt_ids[: len(upto)]) == upto and upto[: len(before)] == before and len(upto) > len(before):
                mask[len(before) : len(upto)] = 1
                break
        else:
            return None
    return mask


def from_regenerated(record: dict, context: list[dict], tokenizer, vocab_size: int) -> tuple[Sample, bool]:
    """A regenerated conversation (data.turns = "regenerate"): the server's exact ids, the last answer
    supervised and, where the template's rendering lines up with those ids, every earlier answer of
    the target too. Returns (sample, whether the earlier answers are supervised)."""
    sample = from_server_ids(record, vocab_size)
    if record.get("regenerated_turns", 1) <= 1:
        return sample, True
    kwargs = (record.get("sampling") or {}).get("chat_template_kwargs") or {}
    history = history_mask(tokenizer, context, record["prompt_token_ids"], kwargs)
    if history is None:
        return sample, False
    mask = sample.loss_mask.copy()
    mask[: len(history)] |= history
    return Sample(sample.input_ids, mask, sample.path), True


def fit_length(sample: Sample, max_len: int, overflow: str) -> tuple[Sample, bool]:
    """Apply tokenize.max_seq_len: (sample, was_truncated); RowError when dropped or left unsupervised."""
    truncated = len(sample.input_ids) > max_len
    if truncated and overflow == "drop":
        raise RowError("too_long", f"{len(sample.input_ids)} tokens > tokenize.max_seq_len={max_len} (overflow=drop)")
    if truncated:
        sample = Sample(sample.input_ids[:max_len], sample.loss_mask[:max_len], sample.path)
    if not sample.loss_mask.any():
        why = "the prompt alone fills tokenize.max_seq_len" if truncated else "no token is supervised"
        raise RowError("no_supervised_tokens", why)
    return sample, truncated
