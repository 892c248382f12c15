"""Samples: what generation sends per prompt, each with its own id and its own sampling settings.

Design choices:
- A prompt yields ``generation.samples_per_prompt`` samples. Sample 0 keeps the prompt's id and
  sample k > 0 is ``ID~sK``: a run made before samples existed resumes unchanged, and raising
  samples_per_prompt later keeps every sample already on disk. Prompt ids are hex hashes, so
  ``~`` never occurs in one and ``prompt_of`` recovers the prompt from any sample or turn id.
- Sampling cycles (``generation.temperatures``, ``top_ps``, ``chat_template_kwargs``,
  ``reasoning_efforts``) are assigned by the sample id alone: sample k of prompt P takes entry
  ``(h(P, list) + k) mod len(list)``. Independent of order, timing and shard layout, so a resumed or
  re-sharded run asks every sample exactly what it asked before; and the samples of one prompt
  take consecutive entries, so two samples of a prompt never share a temperature while the
  list has two or more.
- The settings a sample was asked with travel in its record (``sampling``) and are counted per
  variant in the shard marker, so the manifest says how much data each temperature produced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from eagle3.config import GenerationConfig

SEP = "~"
CYCLES = ("temperatures", "top_ps", "chat_template_kwargs", "reasoning_efforts")


def sample_id(prompt_id: str, k: int) -> str:
    return prompt_id if k == 0 else f"{prompt_id}{SEP}s{k}"


def prompt_of(any_id: str) -> str:
    """The prompt a sample id (or a turn id of one) belongs to."""
    return any_id.split(SEP, 1)[0]


def sample_index(any_id: str) -> int:
    for part in any_id.split(SEP)[1:]:
        if part.startswith("s") and part[1:].isdigit():
            return int(part[1:])
    return 0


def _pick(values: list, name: str, prompt_id: str, k: int):
    h = int.from_bytes(hashlib.sha256(f"eagle3-cycle:{name}:{prompt_id}".encode()).digest()[:8], "big")
    return values[(h + k) % len(values)]


def sampling_for(gen: GenerationConfig, prompt_id: str, k: int, extras: dict | None = None) -> dict:
    """The request fields of sample k of a prompt: max_tokens, temperature, top_p, and the cycled
    reasoning settings when set. ``extras`` (the reasoning mode's request fields) go in first and
    a cycled chat_template_kwargs entry is merged over them."""
    out: dict = {
        "max_tokens": gen.max_tokens,
        "temperature": _pick(gen.temperatures, "temperature", prompt_id, k) if gen.temperatures else gen.temperature,
        "top_p": _pick(gen.top_ps, "top_p", prompt_id, k) if gen.top_ps else gen.top_p,
    }
    kwargs = dict((extras or {}).get("chat_template_kwargs") or {})
    if gen.chat_template_kwargs:
        kwargs.update(_pick(gen.chat_template_kwargs, "chat_template_kwargs", prompt_id, k))
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    if gen.reasoning_efforts:
        out["reasoning_effort"] = _pick(gen.reasoning_efforts, "reasoning_effort", prompt_id, k)
    for key, value in (extras or {}).items():
        if key != "chat_template_kwargs":
            out.setdefault(key, value)
    return out


def variant(sampling: dict) -> str:
    """A stable label of a sample's settings for counting (max_tokens left out: it is the same for all)."""
    parts = {k: v for k, v in sampling.items() if k != "max_tokens"}
    return json.dumps(parts, sort_keys=True, separators=(",", ":"))


def cycle_key_parts(gen: GenerationConfig) -> dict:
    """What the cycles add to the generation key; empty when none is set, so the key of a run made
    before cycles existed does not change."""
    return {name: getattr(gen, name) for name in CYCLES if getattr(gen, name)}


@dataclass(frozen=True)
class Sample:
    id: str
    prompt_id: str
    index: int
    messages: list[dict]
    sampling: dict


def expand(
    prompts: Iterable[tuple[str, list[dict]]], gen: GenerationConfig, extras: dict | None = None
) -> Iterator[Sample]:
    """Every sample of every prompt, prompt by prompt."""
    for pid, messages in prompts:
        for k in range(gen.samples_per_prompt):
            yield Sample(sample_id(pid, k), pid, k, messages, sampling_for(gen, pid, k, extras))


def expected_ids(prompt_ids: Iterable[str], samples_per_prompt: int) -> list[str]:
    return [sample_id(pid, k) for pid in prompt_ids for k in range(samples_per_prompt)]
