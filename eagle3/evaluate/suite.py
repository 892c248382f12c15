"""A fixed, shipped suite of prompts to measure a drafter's acceptance length on.

Design choices:
- Why a fixed suite: the held-out set (``heldout`` in ``prompts.py``) is drawn from each run's own
  prompts, so it changed with every run and two runs' acceptance figures could not be compared. The
  suite is a file shipped with the package (``builtin:eval_suite`` -> ``eagle3/data/eval_suite.jsonl``):
  every run, every drafter and every baseline (no speculation, vLLM's n-gram speculator) is measured on
  the same prompts, in the same order.
- Stable ids: each prompt has an id ``<category>-NNN`` (``chat-001``) that never changes meaning. A
  per-prompt result can be joined across runs by id, and a report names the prompts it used.
  ``suite_fingerprint`` hashes the whole suite (ids, categories, messages, order), so a report also
  shows which version of the suite it measured: an edited prompt changes the fingerprint.
- Categories: acceptance depends heavily on the kind of text (code edits that repeat the prompt suit
  n-gram; free chat does not), so a single mean hides what a drafter is good at. The shipped suite has
  25 prompts in each of ``chat`` (advice, explanations, emails, stories, poems, rewrites), ``code``
  (completing a signature and docstring, or editing a given snippet), ``math`` (word problems,
  conversions, algebra, logic) and ``extract`` (summaries, fields, answers over a given passage). The
  id's prefix must equal its category, so a prompt cannot be filed under the wrong one by mistake.
- Written for the project: every prompt was written fresh for this suite (none comes from a public
  benchmark), short enough for a small chat model (SmolLM2-135M-Instruct) to answer in 128 tokens.
- Strict loading: a suite is small and hand-edited, so any problem is an error (not a skipped row)
  and ``SuiteError`` names the file, the 1-based line and the key. Blank lines are errors too: a suite
  file has exactly one prompt per line. Lines are split on ``\\n`` only (never ``str.splitlines``,
  which would also split on characters such as U+2028 that JSON strings may hold).
- Light: no Prefect, no torch; the standard library and ``eagle3.errors`` only.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path

from eagle3.errors import InputError

BUILTIN_SUITE = "builtin:eval_suite"
_BUILTIN_FILES = {BUILTIN_SUITE: "eval_suite.jsonl"}

KEYS = ("id", "category", "messages")
ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content")
ID_PATTERN = re.compile(r"[a-z][a-z0-9_]*-[0-9]{3}")  # used with fullmatch: ^[a-z][a-z0-9_]*-\d{3}$, ASCII digits


class SuiteError(InputError, ValueError):
    """A suite file is unusable; the message names the file, the 1-based line and the key."""


def suite_path(spec: str) -> Path:
    """The file ``spec`` names: ``builtin:eval_suite`` is the shipped suite, anything else a local path.

    An unknown ``builtin:`` name is an error rather than a relative path of that name.
    """
    if spec in _BUILTIN_FILES:
        return Path(str(resources.files("eagle3") / "data" / _BUILTIN_FILES[spec]))
    if spec.startswith("builtin:"):
        raise SuiteError(f"{spec}: unknown builtin suite (known: {', '.join(_BUILTIN_FILES)})")
    return Path(spec).expanduser()


def _no_duplicate_keys(where: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise SuiteError(f"{where}: key {key!r} appears twice in one object")
            seen[key] = value
        return seen

    return hook


def _check_prompt(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise SuiteError(f"{where}: not a JSON object (got {type(row).__name__})")
    missing = [key for key in KEYS if key not in row]
    if missing:
        raise SuiteError(f"{where}: missing key {missing[0]!r} (a prompt has keys {', '.join(KEYS)})")
    extra = [key for key in row if key not in KEYS]
    if extra:
        raise SuiteError(f"{where}: unexpected key {extra[0]!r} (allowed: {', '.join(KEYS)})")

    prompt_id, category, messages = row["id"], row["category"], row["messages"]
    if not isinstance(prompt_id, str) or not prompt_id:
        raise SuiteError(f"{where}: key 'id' must be a non-empty string, got {prompt_id!r}")
    if not ID_PATTERN.fullmatch(prompt_id):
        raise SuiteError(f"{where}: key 'id' {prompt_id!r} does not match <category>-NNN (e.g. chat-001)")
    if not isinstance(category, str) or not category:
        raise SuiteError(f"{where}: key 'category' must be a non-empty string, got {category!r}")
    prefix = prompt_id.rsplit("-", 1)[0]
    if prefix != category:
        raise SuiteError(f"{where}: key 'id' {prompt_id!r} has prefix {prefix!r}, not its category {category!r}")

    if not isinstance(messages, list) or not messages:
        raise SuiteError(f"{where}: key 'messages' must be a non-empty list")
    for index, message in enumerate(messages):
        key = f"messages[{index}]"
        if not isinstance(message, dict):
            raise SuiteError(f"{where}: key {key!r} must be an object with keys role and content")
        for name in MESSAGE_KEYS:
            if name not in message:
                raise SuiteError(f"{where}: key '{key}.{name}' is missing")
        for name in message:
            if name not in MESSAGE_KEYS:
                raise SuiteError(f"{where}: key '{key}.{name}' is not allowed (a message has role and content)")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise SuiteError(f"{where}: key '{key}.role' is {role!r}, not one of {', '.join(ROLES)}")
        if role == "system" and index != 0:
            raise SuiteError(f"{where}: key '{key}.role': a system message may only come first")
        if not isinstance(content, str) or not content.strip():
            raise SuiteError(f"{where}: key '{key}.content' must be a non-empty string")
    if messages[-1]["role"] != "user":
        last = f"messages[{len(messages) - 1}].role"
        raise SuiteError(f"{where}: key '{last}' is {messages[-1]['role']!r}: the last message must be the user's")

    return {"id": prompt_id, "category": category, "messages": [dict(m) for m in messages]}


def load_suite(spec: str) -> list[dict]:
    """The prompts of suite ``spec`` (see ``suite_path``) in file order, each ``{"id", "category", "messages"}``.

    Raises SuiteError, naming the file and line, at the first problem.
    """
    path = suite_path(spec)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SuiteError(f"{path}: suite file not found") from None
    except IsADirectoryError:
        raise SuiteError(f"{path}: is a folder, not a suite file") from None
    except OSError as exc:
        raise SuiteError(f"{path}: cannot be read ({exc.strerror or exc})") from None

    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise SuiteError(f"{path}:1: the suite file is empty (no prompts)")

    prompts: list[dict] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SuiteError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        if not text.strip():
            raise SuiteError(f"{where}: blank line (a suite file has exactly one JSON object per line)")
        try:
            row = json.loads(text, object_pairs_hook=_no_duplicate_keys(where))
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        prompt = _check_prompt(row, where)
        if prompt["id"] in first_line:
            raise SuiteError(
                f"{where}: key 'id' {prompt['id']!r} duplicates line {first_line[prompt['id']]} (ids must be unique)"
            )
        first_line[prompt["id"]] = number
        prompts.append(prompt)
    return prompts


def categories(prompts: list[dict]) -> dict[str, list[dict]]:
    """The prompts grouped by category, categories in first-seen order, prompts in their given order."""
    grouped: dict[str, list[dict]] = {}
    for prompt in prompts:
        grouped.setdefault(prompt["category"], []).append(prompt)
    return grouped


def suite_fingerprint(prompts: list[dict]) -> str:
    """sha256 hex of a canonical JSON of the prompts (their ids, categories and messages, in order).

    Canonical: sorted keys, no whitespace, UTF-8 (not ASCII escapes); keys other than id, category and
    messages are left out, so the fingerprint depends on the suite's content alone.
    """
    canonical = [{key: prompt[key] for key in KEYS} for prompt in prompts]
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
