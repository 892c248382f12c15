"""Train and save the tiny byte-level BPE tokenizer.

Byte-level BPE (as Qwen3 and Llama-3 use) so any text round-trips. Digits are
split one per token, so arithmetic tokenizes the same way at every length.
The trained vocabulary is sized so that BPE tokens + added tokens land on
``VOCAB_TARGET`` (a multiple of 64, the embedding size), which leaves no unused
embedding rows; should a corpus ever fall short, the builder pads to the next
multiple of 64 and makes those rows unsampleable.

``<think>``/``</think>`` are added *non-special* tokens, as vLLM's qwen3
reasoning parser needs (docs/design.md): vLLM detokenizes with
skip_special_tokens=True by default, so a special ``</think>`` could vanish
from the text the parser splits. The training text is held in memory once per
process (``corpus_documents``) since training and token counting both read it.
The result is wrapped in ``PreTrainedTokenizerFast`` so ``AutoTokenizer`` loads
it offline with eos/pad/bos and the chat template set.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from eagle3.tiny.corpus import iter_documents
from eagle3.tiny.specs import MAX_POSITIONS, THINK_END, THINK_START, VOCAB_TARGET, ArchSpec

# GPT-2-like split, but one digit per piece; contractions, optional-space words,
# punctuation runs (keeping trailing newlines), newline runs, other whitespace.
SPLIT_PATTERN = r"'(?i:s|t|re|ve|m|ll|d)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CORPUS_SEED = 0
CORPUS_DOCS = 16000


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[str, ...]:
    return tuple(iter_documents(CORPUS_SEED, CORPUS_DOCS))


def added_tokens(spec: ArchSpec) -> list[str]:
    return [*spec.specials, THINK_START, THINK_END]


def train_bpe(spec: ArchSpec):
    """Return a ``tokenizers.Tokenizer`` with the arch's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET - len(added_tokens(spec)),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_documents(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    tok.post_processor = _post_processor(spec, tok)
    return tok


def _post_processor(spec: ArchSpec, tok):
    from tokenizers import processors

    # trim_offsets=False keeps character offsets exact, which the assistant
    # mask of apply_chat_template relies on.
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec.bos is None:
        return byte_level
    bos = (spec.bos, tok.token_to_id(spec.bos))
    template = processors.TemplateProcessing(
        single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos}:1 $B:1", special_tokens=[bos]
    )
    return processors.Sequence([byte_level, template])


def wrap(spec: ArchSpec, tok):
    """The HF fast tokenizer around ``tok``, with specials and chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=list(spec.specials),
        chat_template=spec.template_path.read_text(encoding="utf-8"),
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def build_tokenizer(spec: ArchSpec):
    return wrap(spec, train_bpe(spec))


def corpus_token_counts(tok, limit: int = 4000) -> list[int]:
    """Token frequencies over the first ``limit`` corpus documents."""
    counts = [0] * tok.get_vocab_size()
    for enc in tok.encode_batch(list(corpus_documents()[:limit]), add_special_tokens=False):
        for i in enc.ids:
            counts[i] += 1
    return counts


def save_tokenizer(hf_tok, out_dir: Path) -> None:
    hf_tok.save_pretrained(str(out_dir))
    # transformers 5 writes its internal class name and a list under
    # "extra_special_tokens", both of which 4.x cannot load; the 4.x spellings
    # still load the same way in 5.x.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", [])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
