"""Contracts between stages, checked where a stage reads another stage's output.

A stage that reads a shard written by an earlier stage (or by an older version of it, or by a
user's own tool) checks two things before any work, and names what differs:

- the Parquet schema: each column it reads exists and has the type docs/design.md promises. Only the
  footer is read (``pq.read_schema``), so the check costs nothing next to the work it guards.
- the tokenizer: ``input_ids`` mean something only under the tokenizer that made them. The
  tokenize marker records ``tokenizer_sha256`` (``tokenizer_hash``); extract and train compare it
  with the tokenizer the config points at now.

Design choices:
- Types are matched loosely where the meaning is the same (``string``/``large_string``,
  ``list``/``large_list``, any integer width for ids), strictly where it is not (a float
  ``loss_mask`` or string ``input_ids`` is refused).
- ``tokenizer_hash`` covers the files that fix the id of each token, not the chat template (a new
  template changes how future prompts render, not what existing ids mean) nor the model's config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from eagle3.errors import InputError


class SchemaError(InputError, ValueError):
    """A Parquet shard whose columns or types are not the contract's (names file, column, types)."""


class TokenizerMismatchError(InputError, ValueError):
    """Token ids made by one tokenizer, about to be read under another (names both hashes)."""


@dataclass(frozen=True)
class Column:
    name: str
    expected: str  # as a user reads it in the error
    accepts: Callable[[pa.DataType], bool]


def _string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _list_of(inner: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and inner(t.value_type)


def _mask_value(t: pa.DataType) -> bool:
    return pa.types.is_boolean(t) or pa.types.is_uint8(t) or pa.types.is_int8(t)


def _message(t: pa.DataType) -> bool:
    if not pa.types.is_struct(t):
        return False
    fields = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
    return all(k in fields and _string(fields[k]) for k in ("role", "content"))


PROMPT_COLUMNS = (
    Column("id", "string", _string),
    Column("messages", "list<struct<role: string, content: string>>", _list_of(_message)),
)
TOKENIZED_IDS = Column("id", "string", _string)
TOKENIZED_INPUT_IDS = Column("input_ids", "list<int32> (any integer width)", _list_of(pa.types.is_integer))
TOKENIZED_LOSS_MASK = Column("loss_mask", "list<uint8|bool>", _list_of(_mask_value))
TOKENIZED_NUM_TOKENS = Column("num_tokens", "an integer", pa.types.is_integer)


def check_schema(path: str | Path, columns: tuple[Column, ...], what: str) -> pa.Schema:
    """Refuse ``path`` unless it is a Parquet file with ``columns`` of the expected types.

    ``what`` names the contract in the message (e.g. "tokenized shard")."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        schema = pq.read_schema(path)
    except FileNotFoundError:
        raise SchemaError(f"{path}: not found ({what})") from None
    except (pa.ArrowException, OSError) as exc:
        raise SchemaError(f"{path}: not a readable Parquet file ({what}): {exc}") from None
    for col in columns:
        index = schema.get_field_index(col.name)
        if index < 0:
            raise SchemaError(
                f"{path}: column {col.name!r} is missing; a {what} needs it as {col.expected} "
                f"(found columns: {', '.join(schema.names) or 'none'})"
            )
        found = schema.field(index).type
        if not col.accepts(found):
            raise SchemaError(
                f"{path}: column {col.name!r} is {found}, expected {col.expected} (the {what} schema in docs/design.md)"
            )
    return schema


# -- the tokenizer between stages ------------------------------------------------------------

_ID_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "special_tokens_map.json",
)


def tokenizer_hash(path: str) -> str:
    """A hash of what maps text to ids in a tokenizer folder ('' for a hub id: nothing to hash)."""
    folder = Path(path)
    if not folder.is_dir():
        return ""
    digest = hashlib.sha256()
    for name in _ID_FILES:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + hashlib.sha256((folder / name).read_bytes()).digest())
    config = folder / "tokenizer_config.json"
    if config.exists():
        settings = json.loads(config.read_text(encoding="utf-8"))
        settings.pop("chat_template", None)
        digest.update(b"tokenizer_config.json\0" + json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def check_tokenizer(marker: dict, marker_path: str | Path, tokenizer_path: str, now: str, stage: str) -> None:
    """Refuse when the tokenize marker's tokenizer is not the one at ``tokenizer_path`` now, whose
    ``tokenizer_hash`` is ``now`` (hashed once by the caller, not once per shard).

    Markers written before the hash was recorded carry none and pass (their key still covers it)."""
    made = marker.get("tokenizer_sha256")
    if not made:
        return
    if now and now != made:
        raise TokenizerMismatchError(
            f"{marker_path}: the shard was tokenized with tokenizer {marker.get('tokenizer', '?')} (hash "
            f"{made}), but {stage} would read its ids under {tokenizer_path} (hash {now}): the tokenizer changed "
            "between stages. Run `eagle3 tokenize` again (or point tokenize.tokenizer / server.model back at "
            "the tokenizer the ids were made with)"
        )
