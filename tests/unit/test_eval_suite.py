"""The shipped evaluation suite (eagle3/data/eval_suite.jsonl) and its strict loader."""

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

import eagle3
from eagle3.evaluate.suite import (
    BUILTIN_SUITE,
    SuiteError,
    categories,
    load_suite,
    suite_fingerprint,
    suite_path,
)

ROOT = Path(__file__).resolve().parents[2]
CATEGORIES = ("chat", "code", "math", "extract")
# The ids are pinned, not the fingerprint: editing a prompt's wording is allowed, renumbering is not.
EXPECTED_IDS = [f"{category}-{n:03d}" for category in CATEGORIES for n in range(1, 26)]


def _row(prompt_id="chat-001", category="chat", content="Hello?", **extra):
    return {"id": prompt_id, "category": category, "messages": [{"role": "user", "content": content}], **extra}


def _line(row) -> str:
    return json.dumps(row, ensure_ascii=False)


def _write(tmp_path, text: str | bytes) -> Path:
    path = tmp_path / "suite.jsonl"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# --- the shipped suite ---------------------------------------------------------------------------


def test_shipped_suite_parses_with_enough_prompts():
    prompts = load_suite(BUILTIN_SUITE)
    assert len(prompts) >= 80
    assert all(set(p) == {"id", "category", "messages"} for p in prompts)


def test_shipped_suite_ids_are_unique_and_pinned_in_file_order():
    ids = [p["id"] for p in load_suite(BUILTIN_SUITE)]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(EXPECTED_IDS)
    assert ids == EXPECTED_IDS  # file order: category blocks in this order, numbered 001..025


def test_shipped_suite_order_is_deterministic():
    first, second = load_suite(BUILTIN_SUITE), load_suite(BUILTIN_SUITE)
    assert [p["id"] for p in first] == [p["id"] for p in second]
    assert suite_fingerprint(first) == suite_fingerprint(second)


def test_shipped_suite_categories():
    grouped = categories(load_suite(BUILTIN_SUITE))
    assert list(grouped) == list(CATEGORIES)
    for name, prompts in grouped.items():
        assert len(prompts) >= 15, name
        assert all(p["id"].startswith(f"{name}-") for p in prompts)


def test_shipped_prompts_are_distinct_short_and_end_with_the_user():
    prompts = load_suite(BUILTIN_SUITE)
    texts = [json.dumps(p["messages"], sort_keys=True) for p in prompts]
    assert len(texts) == len(set(texts))
    for p in prompts:
        assert p["messages"][-1]["role"] == "user"
        assert sum(len(m["content"]) for m in p["messages"]) < 1500, p["id"]


def test_shipped_file_is_packaged():
    path = suite_path(BUILTIN_SUITE)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["eagle3"]
    relative = path.relative_to(Path(eagle3.__file__).parent).as_posix()
    assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), (relative, patterns)


# --- spec resolution ------------------------------------------------------------------------------


def test_builtin_spec_resolves_to_the_shipped_file():
    path = suite_path(BUILTIN_SUITE)
    assert path == Path(eagle3.__file__).parent / "data" / "eval_suite.jsonl"
    assert path.is_file()


def test_other_specs_are_local_paths(tmp_path):
    path = _write(tmp_path, _line(_row()) + "\n")
    assert suite_path(str(path)) == path
    assert load_suite(str(path)) == [_row()]


def test_unknown_builtin_is_an_error():
    with pytest.raises(SuiteError, match="builtin:nope"):
        suite_path("builtin:nope")


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(SuiteError, match="absent.jsonl"):
        load_suite(str(path))


def test_last_line_without_newline_and_system_turn(tmp_path):
    row = _row("code-001", "code")
    row["messages"].insert(0, {"role": "system", "content": "Be brief."})
    path = _write(tmp_path, _line(_row()) + "\n" + _line(row))
    assert [p["id"] for p in load_suite(str(path))] == ["chat-001", "code-001"]


# --- malformed files: each error names the file, the 1-based line and the key ---------------------


def _with_messages(messages):
    return {"id": "chat-002", "category": "chat", "messages": messages}


GOOD = _line(_row())

MALFORMED = {
    # case: (file text, line named, text the message must contain)
    "invalid-json": (GOOD + '\n{"id": "chat-002",\n', 2, "invalid JSON"),
    "not-an-object": (GOOD + "\n[1, 2]\n", 2, "not a JSON object"),
    "string-not-object": (GOOD + '\n"chat-002"\n', 2, "not a JSON object"),
    "missing-messages": (GOOD + "\n" + _line({"id": "chat-002", "category": "chat"}) + "\n", 2, "'messages'"),
    "missing-id": (_line({"category": "chat", "messages": [{"role": "user", "content": "x"}]}) + "\n", 1, "'id'"),
    "extra-key": (GOOD + "\n" + _line(_row("chat-002", source="x")) + "\n", 2, "'source'"),
    "duplicate-json-key": (GOOD + '\n{"id": "chat-002", "id": "chat-003", "category": "chat"}\n', 2, "'id'"),
    "id-not-string": (_line(_row(7)) + "\n", 1, "'id'"),
    "id-empty": (_line(_row("")) + "\n", 1, "'id'"),
    "id-no-number": (_line(_row("chat")) + "\n", 1, "'id'"),
    "id-two-digits": (_line(_row("chat-01")) + "\n", 1, "'id'"),
    "id-upper-case": (_line(_row("Chat-001", "Chat")) + "\n", 1, "'id'"),
    "id-non-ascii-digits": (_line(_row("chat-\u0661\u0662\u0663")) + "\n", 1, "'id'"),
    "id-trailing-newline": (_line(_row("chat-001\n")) + "\n", 1, "'id'"),
    "duplicate-id": (GOOD + "\n" + _line(_row("chat-002")) + "\n" + GOOD + "\n", 3, "duplicates line 1"),
    "category-not-string": (_line(_row(category=["chat"])) + "\n", 1, "'category'"),
    "category-empty": (_line(_row(category="")) + "\n", 1, "'category'"),
    "id-prefix-not-category": (GOOD + "\n" + _line(_row("code-001", "chat")) + "\n", 2, "'code'"),
    "messages-not-list": (_line({**_row(), "messages": "Hello?"}) + "\n", 1, "'messages'"),
    "messages-empty": (_line({**_row(), "messages": []}) + "\n", 1, "'messages'"),
    "message-not-object": (GOOD + "\n" + _line(_with_messages(["Hello?"])) + "\n", 2, "messages[0]"),
    "role-missing": (_line(_with_messages([{"content": "x"}])) + "\n", 1, "messages[0].role"),
    "role-unknown": (_line(_with_messages([{"role": "bot", "content": "x"}])) + "\n", 1, "messages[0].role"),
    "content-missing": (_line(_with_messages([{"role": "user"}])) + "\n", 1, "messages[0].content"),
    "content-empty": (_line(_with_messages([{"role": "user", "content": ""}])) + "\n", 1, "messages[0].content"),
    "content-blank": (_line(_with_messages([{"role": "user", "content": " \n"}])) + "\n", 1, "messages[0].content"),
    "content-not-string": (_line(_with_messages([{"role": "user", "content": 5}])) + "\n", 1, "messages[0].content"),
    "message-extra-key": (
        _line(_with_messages([{"role": "user", "content": "x", "name": "bob"}])) + "\n",
        1,
        "messages[0].name",
    ),
    "last-not-user": (
        GOOD
        + "\n"
        + _line(_with_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]))
        + "\n",
        2,
        "messages[1].role",
    ),
    "system-not-first": (
        _line(_with_messages([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])) + "\n",
        1,
        "messages[1].role",
    ),
    "blank-line-inside": (GOOD + "\n\n" + _line(_row("chat-002")) + "\n", 2, "blank line"),
    "blank-line-at-end": (GOOD + "\n\n", 2, "blank line"),
    "whitespace-line": (GOOD + "\n   \n", 2, "blank line"),
    "blank-first-line": ("\n", 1, "blank line"),
    "empty-file": ("", 1, "empty"),
    "invalid-utf8": (GOOD.encode() + b"\n" + b'{"id": "chat-002\xff"}\n', 2, "UTF-8"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_names_file_line_and_key(tmp_path, case):
    text, line, needle = MALFORMED[case]
    path = _write(tmp_path, text)
    with pytest.raises(SuiteError) as caught:
        load_suite(str(path))
    message = str(caught.value)
    assert f"{path}:{line}:" in message
    assert needle in message
    assert isinstance(caught.value, ValueError)


# --- categories() and the fingerprint -------------------------------------------------------------


def test_categories_first_seen_order():
    prompts = [_row("math-001", "math"), _row("chat-001"), _row("math-002", "math"), _row("code-001", "code")]
    grouped = categories(prompts)
    assert list(grouped) == ["math", "chat", "code"]
    assert [p["id"] for p in grouped["math"]] == ["math-001", "math-002"]
    assert categories([]) == {}


def test_fingerprint_is_canonical_and_content_sensitive(tmp_path):
    prompts = load_suite(BUILTIN_SUITE)
    fingerprint = suite_fingerprint(prompts)
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0

    # The same suite written with other key order and spacing: the same fingerprint.
    respaced = "\n".join(json.dumps(dict(reversed(list(p.items()))), separators=(", ", " : ")) for p in prompts)
    assert suite_fingerprint(load_suite(str(_write(tmp_path, respaced + "\n")))) == fingerprint

    edited = json.loads(json.dumps(prompts))
    edited[0]["messages"][0]["content"] += "!"
    assert suite_fingerprint(edited) != fingerprint
    assert suite_fingerprint(list(reversed(prompts))) != fingerprint
