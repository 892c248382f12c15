"""Golden normalisation for each schema and each kind of bad row."""

import pytest

from eagle3.prepare.normalize import Prompt, Rejected, candidates, prompt_id, read_conversation

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief.\r\n"},
        {"from": "human", "value": "  What is 2+2?  "},
        {"from": "gpt", "value": "4"},
        {"from": "human", "value": "And 3+3?"},
        {"from": "gpt", "value": "6"},
    ]
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3+3?"}]},
        {"role": "assistant", "content": "6"},
    ]
}
GOLDEN_LAST = (("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4"), ("user", "And 3+3?"))


def only_prompt(row, turns="last_turn"):
    out = candidates(row, turns, 10_000)
    assert len(out) == 1 and isinstance(out[0], Prompt), out
    return out[0]


def test_sharegpt_golden():
    prompt = only_prompt(SHAREGPT)
    assert prompt.messages == GOLDEN_LAST
    assert prompt.id == prompt_id(GOLDEN_LAST) and len(prompt.id) == 32


def test_openai_golden_and_same_id_as_sharegpt():
    assert only_prompt(OPENAI).messages == GOLDEN_LAST
    assert only_prompt(OPENAI).id == only_prompt(SHAREGPT).id


def test_first_turn_and_all_turns():
    assert only_prompt(SHAREGPT, "first_turn").messages == GOLDEN_LAST[:2]
    both = candidates(SHAREGPT, "all_turns", 10_000)
    assert [p.messages for p in both] == [GOLDEN_LAST[:2], GOLDEN_LAST]
    assert both[0].id != both[1].id


def test_trailing_user_turn_without_answer_is_kept():
    row = {"conversations": [{"from": "human", "value": "hi"}]}
    assert only_prompt(row).messages == (("user", "hi"),)


def test_ids_are_pinned():
    # Pinned literals: changing the id scheme would orphan every generation already on disk.
    assert prompt_id((("user", "hi"),)) == "897be8e1f0370e7f41788b5b5337627e"
    assert only_prompt(SHAREGPT).id == "7863b63ceaede09e8c58e544105d19d7"


BAD = [
    ("not_an_object", ["human", "hi"], "row is a JSON list"),
    ("no_conversation", {"text": "hi"}, "keys: text"),
    ("bad_conversation", {"conversations": "hi"}, "'conversations' is str"),
    ("empty", {"messages": []}, "'messages' has no turns"),
    ("bad_turn", {"conversations": ["hi"]}, "turn 0 is str"),
    ("bad_turn", {"conversations": [{"from": "human"}]}, "turn 0 lacks 'from' or 'value'"),
    ("unknown_role", {"conversations": [{"from": "narrator", "value": "x"}]}, "role 'narrator'"),
    ("unknown_role", {"messages": [{"role": None, "content": "x"}]}, "role None"),
    ("non_string_content", {"conversations": [{"from": "human", "value": 42}]}, "turn 0 content is int"),
    ("non_string_content", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content is list"),
    (
        "no_user_turn",
        {"conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "a"}]},
        "no user turn",
    ),
    ("empty_content", {"conversations": [{"from": "human", "value": "   "}]}, "turn 0 (user) is empty"),
    (
        "empty_content",
        {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}]},
        "turn 0 (system) is empty",
    ),
]


@pytest.mark.parametrize("kind, row, detail", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_rows_are_rejected_with_kind_and_detail(kind, row, detail):
    out = candidates(row, "last_turn", 10_000)
    assert len(out) == 1 and isinstance(out[0], Rejected)
    assert out[0].kind == kind
    assert detail in out[0].detail


def test_too_long_is_per_prompt_in_all_turns_mode():
    row = {
        "conversations": [
            {"from": "human", "value": "short"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "x" * 50},
        ]
    }
    first, second = candidates(row, "all_turns", 20)
    assert isinstance(first, Prompt)
    assert (
        isinstance(second, Rejected)
        and second.kind == "too_long"
        and "56 characters > data.max_prompt_chars=20" in second.detail
    )


def test_empty_answer_after_last_user_turn_does_not_matter():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}
    assert only_prompt(row).messages == (("user", "q"),)


def test_read_conversation_maps_roles():
    conv = read_conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})
    assert conv == [("user", "a"), ("assistant", "b")]
