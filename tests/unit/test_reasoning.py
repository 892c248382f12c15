"""Reasoning modes (generation.reasoning = keep | drop | disable): what each template can express,
the request fields, golden rows per tiny template, and the tokenize stage per mode."""

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "golden"))
from reasoning_cases import build_row, cases, render_all  # noqa: E402

from eagle3.config import DEMO_RECIPE, ConfigError, load_config  # noqa: E402
from eagle3.errors import InputError  # noqa: E402
from eagle3.markers import read_marker  # noqa: E402
from eagle3.prepare.stage import run_prepare  # noqa: E402
from eagle3.reasoning import (  # noqa: E402
    ReasoningModeError,
    check_config,
    check_mode,
    renders_reasoning,
    request_extras,
    request_extras_for,
    strip_reasoning,
)
from eagle3.records import JsonlAppender  # noqa: E402
from eagle3.run_facts import RunFacts
from eagle3.tokenize.build import answer_only, render_ids  # noqa: E402
from eagle3.tokenize.stage import tokenize_shard  # noqa: E402
from eagle3.tokenizer import load_tokenizer, tokenizer_path  # noqa: E402
from test_tokenize import segments  # noqa: E402
from tokenize_cases import tokenizer_for  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "reasoning.json"

# What each pinned row supervises, decoded: the drafter's lesson in each mode, readable.
SUPERVISED = {
    "tiny-qwen3/keep/single": ["Two plus two is four.\n</think>\n\n4<|im_end|>"],
    "tiny-qwen3/keep/multi": ["7<|im_end|>", "Two is the only even prime.\n</think>\n\n2<|im_end|>"],
    # drop: the empty think block's end the target writes when it does not reason, then the answer
    "tiny-qwen3/drop/single": ["\n</think>\n\n4<|im_end|>"],
    "tiny-qwen3/drop/multi": ["\n</think>\n\n2<|im_end|>"],
    "tiny-qwen3/drop/single/server-ids": ["\n</think>\n\n4<|im_end|>"],
    "tiny-qwen3/drop/multi/server-ids": ["\n</think>\n\n2<|im_end|>"],
    # disable: the empty think block is part of the prompt; the answer alone is written
    "tiny-qwen3/disable/single": ["4<|im_end|>"],
    "tiny-qwen3/disable/multi": ["7<|im_end|>", "2<|im_end|>"],
    "tiny-llama/keep/single": ["4<|eot_id|>"],
    "tiny-llama/keep/multi": ["7<|eot_id|>", "2<|eot_id|>"],
}


# ----------------------------------------------------------------------------- goldens


def test_goldens_are_current():
    assert render_all() == json.loads(GOLDEN.read_text()), (
        "ids changed: if deliberate, run tests/golden/reasoning_cases.py"
    )


@pytest.mark.parametrize("key", sorted(SUPERVISED))
def test_each_mode_supervises_what_the_target_writes(key):
    golden = json.loads(GOLDEN.read_text())[key]
    tok = tokenizer_for(key.split("/")[0])
    assert len(golden["input_ids"]) == len(golden["loss_mask"])
    assert segments(tok, golden["input_ids"], golden["loss_mask"]) == SUPERVISED[key]


def test_every_golden_row_has_its_readable_twin():
    assert set(SUPERVISED) == set(json.loads(GOLDEN.read_text()))


def test_drop_splits_prompt_and_answer_where_the_server_does():
    """The prompt ends as vLLM tokenizes it (``<think>``, ``\\n``) and the answer is tokenized apart:
    rendering the whole text at once would merge the two newlines into one token the target never
    reads after its prompt."""
    tok = tokenizer_for("tiny-qwen3")
    for conv in ("single", "multi"):
        key = f"tiny-qwen3/drop/{conv}"
        messages, record = next(c[3:] for c in cases() if c[0] == key)
        row = build_row(tok, messages, record, "drop")
        prompt = render_ids(tok, messages, add_generation_prompt=True)
        assert row.input_ids[: len(prompt)].tolist() == prompt and not row.loss_mask[: len(prompt)].any()
        assert row.loss_mask[len(prompt) :].all()
        assert [tok.decode([i]) for i in prompt[-2:]] == ["<think>", "\n"]


def test_drop_takes_the_prompt_ids_from_the_record():
    tok = tokenizer_for("tiny-qwen3")
    messages, record = next(c[3:] for c in cases() if c[0] == "tiny-qwen3/drop/single/server-ids")
    record = {**record, "prompt_token_ids": record["prompt_token_ids"][1:]}  # what the server read, whatever it was
    row = answer_only(tok, messages, record, len(tok))
    assert row.input_ids[: len(record["prompt_token_ids"])].tolist() == record["prompt_token_ids"]
    assert row.path == "answer_only"


def test_drop_filters_a_record_with_no_answer_and_strips_unparsed_reasoning():
    from eagle3.tokenize.build import RowError

    tok = tokenizer_for("tiny-qwen3")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    with pytest.raises(RowError) as err:
        answer_only(tok, messages, {"content": None, "reasoning": "cut by max_tokens here"}, len(tok))
    assert err.value.kind == "reasoning_only"
    unparsed = answer_only(tok, messages, {"content": "Two plus two.\n</think>\n\n4", "reasoning": None}, len(tok))
    parsed = answer_only(tok, messages, {"content": "4", "reasoning": "Two plus two."}, len(tok))
    assert unparsed.input_ids.tolist() == parsed.input_ids.tolist()
    assert unparsed.loss_mask.tolist() == parsed.loss_mask.tolist()
    assert strip_reasoning("a</think>b</think>\n\nc") == "\n\nc" and strip_reasoning("plain") == "plain"


# ----------------------------------------------------------------------------- what a template can express


@pytest.mark.parametrize(
    "template, mode, why",
    [
        ("tiny-llama", "drop", "never renders reasoning"),
        ("tiny-llama", "disable", "has no enable_thinking switch"),
        ("plain-chatml", "drop", "never renders reasoning"),
        ("plain-chatml", "disable", "has no enable_thinking switch"),
    ],
)
def test_a_mode_the_template_cannot_express_is_a_config_error_naming_key_and_template(template, mode, why):
    text = tokenizer_for(template).chat_template
    with pytest.raises(ReasoningModeError) as err:
        check_mode(mode, text, template)
    message = str(err.value)
    assert "generation.reasoning" in message and repr(mode) in message
    assert f"chat template of {template}" in message and why in message
    assert isinstance(err.value, InputError) and isinstance(err.value, ConfigError)
    with pytest.raises(ReasoningModeError, match=f"generation.reasoning = {mode!r}"):
        request_extras(mode, text)  # generation never sends a request the template would ignore


@pytest.mark.parametrize("template", ["tiny-qwen3", "tiny-llama", "plain-chatml"])
def test_keep_works_with_every_template_and_asks_nothing_extra(template):
    text = tokenizer_for(template).chat_template
    check_mode("keep", text, template)
    assert request_extras("keep", text) == {}


def test_request_extras_per_mode_on_the_thinking_template():
    text = tokenizer_for("tiny-qwen3").chat_template
    for mode in ("keep", "drop", "disable"):
        check_mode(mode, text, "tiny-qwen3")
    assert request_extras("disable", text) == {"chat_template_kwargs": {"enable_thinking": False}}
    assert request_extras("drop", text) == {} and request_extras("keep", text) == {}


def test_the_rules_read_template_code_not_comments():
    commented = "{#- reasoning_content, message.reasoning, </think> and enable_thinking are ignored here -#}{{ x }}"
    for mode in ("drop", "disable"):
        with pytest.raises(ReasoningModeError):
            check_mode(mode, commented, "commented")
    assert renders_reasoning("{{ message['reasoning_content'] }}") and renders_reasoning("{{ m.thinking }}")
    assert renders_reasoning("{{ content.split('</think>')[-1] }}") and not renders_reasoning("{{ reasoning_effort }}")
    check_mode("disable", "{% if enable_thinking is false %}<think></think>{% endif %}", "switch only")
    for mode in ("drop", "disable"):
        with pytest.raises(ReasoningModeError, match="is missing"):
            check_mode(mode, "", "no-template")


def test_the_config_field_defaults_to_keep_and_rejects_other_values():
    assert load_config(DEMO_RECIPE, []).generation.reasoning == "keep"
    with pytest.raises(ConfigError, match="generation.reasoning"):
        load_config(DEMO_RECIPE, ['generation.reasoning="none"'])


def test_the_cli_preflight_and_check_config_name_the_model(demo_config):
    from cli.main import _preflight

    bad = demo_config('server.model="tiny:llama"', 'generation.reasoning="disable"')
    with pytest.raises(ReasoningModeError, match=r"generation.reasoning = 'disable': the chat template of tiny:llama"):
        _preflight(bad, "tokenize")
    check_config(demo_config('generation.reasoning="disable"'))  # the tiny Qwen3 target has the switch
    check_config(demo_config('server.model="tiny:llama"'))  # keep: always fine


def test_a_pipeline_run_from_the_ui_fails_on_the_mode_before_any_stage(demo_config, monkeypatch):
    """The Prefect form path (no CLI preflight): the parent flow checks the mode first."""
    import asyncio

    import flows.pipeline as pipeline

    ran = []
    monkeypatch.setattr(pipeline, "run_stages", lambda *a: ran.append(a))
    bad = demo_config('server.model="tiny:llama"', 'generation.reasoning="disable"')
    with pytest.raises(ReasoningModeError, match="generation.reasoning = 'disable'"):
        asyncio.run(pipeline.pipeline_flow.fn(bad))
    assert ran == []


def test_request_extras_for_a_config_read_the_served_template(demo_config):
    assert request_extras_for(demo_config('generation.reasoning="disable"')) == {
        "chat_template_kwargs": {"enable_thinking": False}
    }
    assert request_extras_for(demo_config('generation.reasoning="drop"')) == {}
    assert request_extras_for(demo_config('server.model="no/such-model"')) == {}  # keep reads no model
    external = ('server.mode="external"', 'server.urls=["http://127.0.0.1:9/v1"]', 'server.model="tiny:llama"')
    with pytest.raises(ReasoningModeError, match="disable': the chat template of tiny:llama"):
        request_extras_for(demo_config(*external, 'generation.reasoning="disable"'))


# ----------------------------------------------------------------------------- the stage


def make_run(tmp_path, mode, *, ids=True, sets=()):
    """A prepared run of six prompts plus one generation record each, made as vLLM would for ``mode``."""
    src = tmp_path / "p.jsonl"
    src.write_text(
        "".join(json.dumps({"conversations": [{"from": "human", "value": f"item {i}?"}]}) + "\n" for i in range(6))
    )
    config = load_config(
        DEMO_RECIPE,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'data.source="{src}"',
            "data.num_shards=1",
            f'generation.reasoning="{mode}"',
            *sets,
        ],
    )
    run_prepare(config)
    table = pq.read_table(Path(config.run_dir) / "prompts" / "shard-00000.parquet").to_pylist()
    tok = load_tokenizer(tokenizer_path(config))
    kwargs = {"enable_thinking": False} if mode == "disable" else {}
    end = tok.convert_tokens_to_ids("<|im_end|>")
    records = []
    for k, row in enumerate(table):
        reasoning, content = (None if mode == "disable" else f"Thinking about item {k}."), f"Item {k} it is."
        rec = {"id": row["id"], "content": content, "reasoning": reasoning, "finish_reason": "stop"}
        if k == 5 and mode != "disable":
            rec.update(content=None, finish_reason="length")  # cut inside its reasoning
        if ids:
            text = (reasoning or "") + (f"\n</think>\n\n{rec['content']}" if reasoning and rec["content"] else "")
            text = text or rec["content"]
            rec["prompt_token_ids"] = render_ids(tok, row["messages"], add_generation_prompt=True, **kwargs)
            rec["completion_token_ids"] = tok.encode(text, add_special_tokens=False) + [end] * bool(rec["content"])
        records.append(rec)
    gen = Path(config.run_dir) / "generations"
    gen.mkdir(parents=True, exist_ok=True)
    with JsonlAppender(gen / "shard-00000.jsonl") as out:
        for rec in records:
            out.append(rec)
    (gen / "shard-00000.done.json").write_text("{}")
    return config, tok, {r["id"]: r for r in table}, records


def run_stage(config, tok):
    return tokenize_shard(RunFacts.resolve(config), "shard-00000.parquet", tok)


def rows(config):
    return {r["id"]: r for r in pq.read_table(Path(config.run_dir) / "tokenized" / "shard-00000.parquet").to_pylist()}


def with_mode(config, mode):
    return config.model_copy(update={"generation": config.generation.model_copy(update={"reasoning": mode})})


@pytest.mark.parametrize("ids", [True, False], ids=["server-ids", "template"])
def test_stage_drop_builds_answer_only_rows_and_filters_reasoning_only_records(tmp_path, ids):
    config, tok, prompts, records = make_run(tmp_path, "drop", ids=ids)
    result = run_stage(config, tok)
    assert (result.in_, result.ok, result.filtered, result.reasons) == (6, 5, 1, {"reasoning_only": 1})
    out = rows(config)
    for rec in records[:5]:
        expected = build_row(tok, prompts[rec["id"]]["messages"], rec, "drop")
        row = out[rec["id"]]
        assert (row["input_ids"], row["loss_mask"]) == (expected.input_ids.tolist(), expected.loss_mask.tolist())
        assert row["path"] == "answer_only"
        [answer] = segments(tok, row["input_ids"], row["loss_mask"])
        assert answer == f"\n</think>\n\n{rec['content']}<|im_end|>" and "Thinking" not in tok.decode(row["input_ids"])


@pytest.mark.parametrize("ids", [True, False], ids=["server-ids", "template"])
def test_stage_disable_renders_with_thinking_off(tmp_path, ids):
    config, tok, prompts, records = make_run(tmp_path, "disable", ids=ids)
    result = run_stage(config, tok)
    assert (result.in_, result.ok, result.filtered) == (6, 6, 0)
    out = rows(config)
    for rec in records:
        expected = build_row(tok, prompts[rec["id"]]["messages"], rec, "disable")
        row = out[rec["id"]]
        assert (row["input_ids"], row["loss_mask"]) == (expected.input_ids.tolist(), expected.loss_mask.tolist())
        assert segments(tok, row["input_ids"], row["loss_mask"]) == [f"{rec['content']}<|im_end|>"]
        assert "<think>\n\n</think>\n\n" in tok.decode(row["input_ids"])
    if ids:  # the template check renders with the same switch: the prompts match
        assert result.template_check["checked"] == 6 and result.template_check["prompt_mismatch"] == 0


def test_the_tokenize_key_changes_with_the_mode(tmp_path):
    config, tok, _, _ = make_run(tmp_path, "keep")
    done = Path(config.run_dir) / "tokenized" / "shard-00000.done.json"
    keys = {}
    for mode in ("keep", "drop", "disable", "keep"):
        result = run_stage(with_mode(config, mode), tok)
        keys.setdefault(mode, read_marker(done, "tokenize").key)
        assert read_marker(done, "tokenize").key == keys[mode]
        assert not result.skipped, f"{mode}: the rows differ from the last run's, so the shard is rebuilt"
    assert len(set(keys.values())) == 3
    assert run_stage(config, tok).skipped  # same mode, same inputs: nothing to do


def test_stage_refuses_a_mode_the_tokenizers_template_cannot_express(tmp_path):
    config, tok, _, _ = make_run(tmp_path, "keep")
    llama = tokenizer_for("tiny-llama")
    llama_path = str(Path(llama.name_or_path))
    for mode in ("drop", "disable"):
        with pytest.raises(ReasoningModeError, match=rf"generation.reasoning = '{mode}': the chat template of /"):
            moded = with_mode(config, mode)
            moded = moded.model_copy(update={"tokenize": moded.tokenize.model_copy(update={"tokenizer": llama_path})})
            tokenize_shard(RunFacts.resolve(moded), "shard-00000.parquet", llama)
    assert not (Path(config.run_dir) / "tokenized" / "shard-00000.done.json").exists()
