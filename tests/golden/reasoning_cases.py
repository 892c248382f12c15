"""The rows tokenize builds per reasoning mode (generation.reasoning), pinned in tests/golden/reasoning.json.

One generation record per conversation of tokenize_cases.py (its final assistant turn becomes the
record's content and reasoning), without server ids (the template path) and, for drop, with them
(drop takes the prompt ids from the record). Only the modes each tiny template can express; the
others are config errors (tests/unit/test_reasoning.py).

Regenerate after a deliberate tokenizer, template or reasoning-mode change:
    .venv/bin/python tests/golden/reasoning_cases.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

from tokenize_cases import CONVERSATIONS, tokenizer_for  # noqa: E402

MODES = {"tiny-qwen3": ("keep", "drop", "disable"), "tiny-llama": ("keep",)}


def prompt_and_record(conv_name: str, tok=None, mode: str = "keep") -> tuple[list[dict], dict]:
    """The prompt messages and the generation record of one conversation; with ``tok``, the
    record carries server ids as vLLM would send them for ``mode``."""
    *messages, final = CONVERSATIONS[conv_name]
    record = {"id": conv_name, "content": final["content"], "reasoning": final["reasoning_content"]}
    if tok is not None:
        from eagle3.reasoning import template_kwargs
        from eagle3.tokenize.build import render_ids

        kwargs = template_kwargs(mode, tok.chat_template)
        text = (
            final["content"] if mode == "disable" else f"{final['reasoning_content']}\n</think>\n\n{final['content']}"
        )
        end = tok.convert_tokens_to_ids("<|im_end|>")
        record["prompt_token_ids"] = render_ids(tok, messages, add_generation_prompt=True, **kwargs)
        record["completion_token_ids"] = tok.encode(text, add_special_tokens=False) + [end]
    return messages, record


def build_row(tok, messages: list[dict], record: dict, mode: str):
    """One row as tokenize builds it (the stage batches the template path; the tests compare)."""
    from eagle3.reasoning import template_kwargs
    from eagle3.tokenize.build import answer_only, conversation, from_server_ids, from_template, has_ids

    if mode == "drop":
        return answer_only(tok, messages, record, len(tok))
    if has_ids(record):
        return from_server_ids(record, len(tok))
    return from_template(tok, conversation(messages, record), template_kwargs(mode, tok.chat_template))


def cases():
    """(key, template, mode, messages, record) of every pinned row."""
    for template, modes in MODES.items():
        tok = tokenizer_for(template)
        for mode in modes:
            for conv_name in sorted(CONVERSATIONS):
                yield f"{template}/{mode}/{conv_name}", tok, mode, *prompt_and_record(conv_name)
                if mode == "drop":
                    yield f"{template}/{mode}/{conv_name}/server-ids", tok, mode, *prompt_and_record(conv_name, tok)


def render_all() -> dict:
    out = {}
    for key, tok, mode, messages, record in cases():
        sample = build_row(tok, messages, record, mode)
        out[key] = {"input_ids": sample.input_ids.tolist(), "loss_mask": sample.loss_mask.tolist()}
    return out


if __name__ == "__main__":
    (HERE / "reasoning.json").write_text(json.dumps(render_all(), indent=1) + "\n")
    print(f"wrote {HERE / 'reasoning.json'}")
