"""The conversations and templates whose exact ids and masks are pinned in tests/golden/tokenize.json.

Regenerate after a deliberate tokenizer or template change (eagle3.tiny BUILD_VERSION bump):
    .venv/bin/python tests/golden/tokenize_cases.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1])]

# A ChatML template without generation markers: masks come from prefix diffing.
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = {
    "single": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
    ],
    "multi": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "Seven has no divisors."},
        {"role": "user", "content": "And an even one?"},
        {"role": "assistant", "content": "2", "reasoning_content": "Two is the only even prime."},
    ],
}

TEMPLATES = ("tiny-qwen3", "tiny-llama", "plain-chatml")

# data.turns = "regenerate": the context of the third turn holds the target's own answers to the first
# two (as generation puts them back: content, and reasoning when the server split it off); the record
# carries the server's ids of that context and of the third answer.
REGENERATED_CONTEXT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7", "reasoning_content": "Seven has no divisors."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "2", "reasoning_content": "Two is the only even prime."},
    {"role": "user", "content": "Their sum?"},
]
REGENERATED_ANSWER = {"content": "9", "reasoning": "Seven plus two."}


def regenerated_record(tok) -> dict:
    """The record generation writes for REGENERATED_CONTEXT, with ids as the server makes them
    (the template's rendering, the answer's ids being what follows the generation prompt)."""
    from eagle3.tokenize.build import conversation, render_ids

    prompt = render_ids(tok, REGENERATED_CONTEXT, add_generation_prompt=True)
    full = render_ids(tok, conversation(REGENERATED_CONTEXT, REGENERATED_ANSWER))
    assert full[: len(prompt)] == prompt, "the template's generation prompt is not a prefix of the answered turn"
    return {
        **REGENERATED_ANSWER,
        "prompt_token_ids": prompt,
        "completion_token_ids": full[len(prompt) :],
        "regenerated_turns": 3,
        "messages": REGENERATED_CONTEXT,
    }


def tokenizer_for(name: str):
    from transformers import AutoTokenizer

    from eagle3.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny("llama" if name == "tiny-llama" else "qwen3")))
    if name == "plain-chatml":
        tok.chat_template = PLAIN_CHATML
    return tok


def render_all() -> dict:
    from eagle3.tokenize.build import from_regenerated, from_template

    out = {}
    for name in TEMPLATES:
        tok = tokenizer_for(name)
        for conv_name, conv in CONVERSATIONS.items():
            sample = from_template(tok, conv)
            out[f"{name}/{conv_name}"] = {
                "input_ids": sample.input_ids.tolist(),
                "loss_mask": sample.loss_mask.tolist(),
            }
        sample, history = from_regenerated(regenerated_record(tok), REGENERATED_CONTEXT, tok, len(tok))
        assert history, f"{name}: the earlier answers of a regenerated conversation are not supervised"
        out[f"{name}/regenerated"] = {"input_ids": sample.input_ids.tolist(), "loss_mask": sample.loss_mask.tolist()}
    return out


if __name__ == "__main__":
    (HERE / "tokenize.json").write_text(json.dumps(render_all(), indent=1) + "\n")
    print(f"wrote {HERE / 'tokenize.json'}")
