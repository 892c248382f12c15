"""What the fake server does: its config and the fault rules (JSON-serialisable for a subprocess)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

FAULT_KINDS = ("hang", "status", "reset", "slow", "malformed")
MIX_KINDS = ("hang", "reset", "slow", "malformed", "5xx")  # plus any status code written as digits: "429"
SERVER_ERRORS = (500, 502, 503, 504)
MALFORMED_BODY = '{"id":"chatcmpl-broken","object":"chat.completion","choices":[{"index":0,"mess'


@dataclass
class FaultRule:
    """Fail requests whose last user message contains `match`: the first `times` attempts (None: all)."""

    match: str
    kind: str  # hang | status | reset | slow | malformed
    times: int | None = 1
    status: int | None = None  # kind "status": the HTTP code to answer
    retry_after: float | None = None  # kind "status": a Retry-After header, in seconds
    delay_s: float = 0.0  # kind "slow": wait this long, then answer normally
    body: str | None = None  # kind "malformed": the 200 body (default: truncated JSON)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FaultRule.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.kind == "status" and not (self.status and 400 <= self.status <= 599):
            raise ValueError(f"FaultRule(kind='status') needs status in 400..599, got {self.status!r}")
        if self.times is not None and self.times < 0:
            raise ValueError(f"FaultRule.times must be >= 0 or None, got {self.times}")


@dataclass
class FakeConfig:
    """Everything the fake server does; JSON-serialisable so a subprocess can take it on the command line."""

    model: str = "fake-target"
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    slots: int | None = None  # concurrent generations (vLLM's max_num_seqs); None: unbounded
    tokens_per_s: float | None = None  # decode speed per slot; None or 0: no decode time
    ttft_s: float = 0.0  # fixed prefill time per request, spent holding a slot
    rules: list[FaultRule] = field(default_factory=list)
    fault_rate: float = 0.0  # random faults: probability per attempt, keyed on (seed, prompt, attempt)
    fault_mix: dict[str, float] = field(default_factory=lambda: {"hang": 0.25, "429": 0.25, "5xx": 0.25, "reset": 0.25})
    hang_s: float = 3600.0  # a hang closes the connection (no response) after this long
    slow_s: float = 1.0  # random "slow" faults: extra delay before answering
    fault_retry_after: float | None = None  # Retry-After on random 429/503 faults
    max_prompt_chars: int = 100_000  # longer prompts get vLLM's 400 "maximum context length"
    max_model_len: int = 32_768  # reported by /v1/models and in the context-length message
    median_tokens: int | None = None  # median natural completion length; None: max_tokens / 4
    length_sigma: float = 1.0  # lognormal sigma of the completion length (heavy tail)
    seed: int = 0
    reasoning: bool = True  # as if vLLM ran with a reasoning parser (message.reasoning filled)
    # /v1/completions: choice k of a request with seed s answers completion_script[(s + k) % len] (vLLM seeds
    # its n samples s + k); None: a slice of the fake token stream, as long as a chat answer would be.
    completion_script: list[str] | None = None

    def __post_init__(self) -> None:
        self.rules = [r if isinstance(r, FaultRule) else FaultRule(**r) for r in self.rules]
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1 or None, got {self.slots}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate}")
        for kind, weight in self.fault_mix.items():
            if kind not in MIX_KINDS and not (kind.isdigit() and 400 <= int(kind) <= 599):
                raise ValueError(f"fault_mix key {kind!r}: use {MIX_KINDS} or a status code such as '429'")
            if weight < 0:
                raise ValueError(f"fault_mix weight for {kind!r} is negative")
        if self.fault_rate > 0 and sum(self.fault_mix.values()) <= 0:
            raise ValueError("fault_rate > 0 needs a fault_mix with positive weight")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FakeConfig:
        return cls(**json.loads(text))
