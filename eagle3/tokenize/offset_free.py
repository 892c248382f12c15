"""Generation-span masks from token ids alone, for byte-level BPE tokenizers.

The template path needs, per row, the tokens that overlap the template's generation spans
(character ranges of the rendered text). ``encode_batch`` answers that through character
offsets, and tracking them is a large share of the Rust encode: measured on the benchmark's
data, ``encode_batch_fast`` (no offsets) takes 20% less CPU on ~320-token rows and 36% less on
~3,200-token rows. For a byte-level BPE tokenizer the offsets follow from the ids: every token
stands for a fixed number of input bytes (its vocabulary string has one character per byte;
an added token is its content), and the tokens tile the text in order. So on an ASCII text
(bytes = characters) the token holding character ``c`` is the first whose cumulative length
exceeds ``c``: exactly what ``Encoding.char_to_token`` returns.

When that holds is checked, never assumed:
- ``byte_lengths`` accepts only tokenizers whose every step keeps the tiling: BPE without byte
  fallback or subword affixes, no normalizer (or NFC, the identity on ASCII), pre-tokenizers
  that only split (ByteLevel without an added prefix space, Split that keeps its matches,
  Digits), post-processors that leave offsets alone, added tokens that absorb no whitespace,
  and a vocabulary entirely in the byte-level alphabet; anything else gets None (offsets as
  before);
- per row: ASCII text only, the token lengths must add up to the text's length, and every span
  edge must fall on a token; a row that fails any of these is encoded with offsets;
- ``CHECK_EVERY``: the first row of every batch and every 64th one is also encoded with offsets
  and must give the same ids and mask, else ``MaskMismatch`` stops the run.
"""

from __future__ import annotations

import json

import numpy as np

from eagle3.errors import PermanentError

CHECK_EVERY = 64

_CACHE: dict[int, tuple[object, int, np.ndarray | None]] = {}


class MaskMismatch(PermanentError, RuntimeError):
    """The offset-free mask disagreed with the tokenizer's own offsets."""


def _pre_tokenizer_ok(spec) -> bool:
    if not isinstance(spec, dict):
        return False
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    byte_level = False
    for step in steps or []:
        kind = step.get("type")
        if kind == "ByteLevel" and not step.get("add_prefix_space"):
            byte_level = True
        elif kind == "Split" and step.get("behavior") != "Removed":
            continue
        elif kind != "Digits":
            return False
    return byte_level


def _post_processor_ok(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_post_processor_ok(step) for step in spec.get("processors") or [])
    return kind == "TemplateProcessing" or (kind == "ByteLevel" and not spec.get("trim_offsets"))


def _table(spec: dict) -> np.ndarray | None:
    from tokenizers import pre_tokenizers

    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    if (
        spec.get("normalizer") not in (None, {"type": "NFC"})
        or not _pre_tokenizer_ok(spec.get("pre_tokenizer"))
        or not _post_processor_ok(spec.get("post_processor"))
    ):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    if not vocab or any(not alphabet.issuperset(piece) for piece in vocab):
        return None
    table = np.zeros(
        1 + max([*vocab.values(), *(t["id"] for t in added)]), dtype=np.int64
    )  # 0: an unknown id fails the length check
    for piece, i in vocab.items():
        table[i] = len(piece)
    for t in added:
        table[t["id"]] = len(t["content"].encode())
    return table


def byte_lengths(backend) -> np.ndarray | None:
    """Input bytes per token id, or None when ids alone cannot place tokens (see the module doc)."""
    size = backend.get_vocab_size(with_added_tokens=True)
    hit = _CACHE.get(id(backend))
    if hit is None or hit[0] is not backend or hit[1] != size:
        hit = (backend, size, _table(json.loads(backend.to_str())))
        if len(_CACHE) >= 8:  # a process loads few tokenizers; never hold many alive
            _CACHE.clear()
        _CACHE[id(backend)] = hit
    return hit[2]


def masks(
    table: np.ndarray, ids: list[np.ndarray], texts: list[str], spans: list[list[tuple[int, int]]]
) -> list[np.ndarray | None]:
    """Per row: the uint8 mask of tokens overlapping its spans, or None where the row's token
    lengths do not tile its (ASCII) text or a span edge falls outside it (use offsets there)."""
    n = len(ids)
    if n == 0:
        return []
    counts = np.fromiter((len(x) for x in ids), dtype=np.int64, count=n)
    bounds = np.cumsum(counts)
    flat = np.concatenate(ids) if int(bounds[-1]) else np.zeros(0, dtype=np.int32)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= len(table)):
        return [None] * n
    ends = np.cumsum(table[flat])
    starts = bounds - counts  # first token of each row
    padded = np.concatenate([np.zeros(1, dtype=np.int64), ends])
    base = padded[starts]  # bytes before each row
    total = padded[bounds] - base
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=n)
    ok = total == lengths
    rows, lo, hi = [], [], []
    for r, row_spans in enumerate(spans):
        for start, end in row_spans:
            if end <= start:
                continue
            if not (0 <= start and end <= lengths[r]):
                ok[r] = False
                continue
            rows.append(r)
            lo.append(start)
            hi.append(end - 1)
    rows_a = np.asarray(rows, dtype=np.int64)
    keep = ok[rows_a] if rows else np.zeros(0, dtype=bool)
    rows_a = rows_a[keep]
    first = np.searchsorted(ends, base[rows_a] + np.asarray(lo, dtype=np.int64)[keep], side="right")
    last = np.searchsorted(ends, base[rows_a] + np.asarray(hi, dtype=np.int64)[keep], side="right")
    delta = np.bincount(first, minlength=flat.size + 1) - np.bincount(last + 1, minlength=flat.size + 1)
    mask = (np.cumsum(delta[: flat.size]) > 0).astype(np.uint8)
    pieces = np.split(mask, bounds[:-1])
    return [pieces[r] if ok[r] else None for r in range(n)]
