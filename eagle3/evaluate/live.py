"""Live acceptance: the target served by vLLM with the exported drafter, measured from /metrics.

Design choices:
- The numbers are vLLM's own counters (``vllm:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position="k"}``), read before and after each
  temperature's batch of requests; the difference is that batch's. Mean acceptance length =
  1 + accepted / drafts (each verification step also yields the target's own token).
- Prompts are the held-out split (``train.eval_fraction``, by id hash as training uses), so
  the drafter is measured on conversations it never trained on. When fewer exist than
  ``evaluate.num_prompts``, the rest is topped up from the training prompts in a fixed hash
  order and the result says so.
- One server start for all temperatures (a start costs 30-60 s on CPU, minutes on GPU).
- Every request has explicit connect/read timeouts and no retries: a failed request is
  counted as failed, never silently replaced (the counters would still include its drafts).
- Requests run in a small thread pool with a synchronous client, so this works whether or
  not the caller already runs an event loop (Prefect tasks may).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from eagle3.config import PipelineConfig, section_hash
from eagle3.durable import atomic_write_json, read_json
from eagle3.manifest import StageCounts, record_stage, versions

STAGE = "evaluate"
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
METRICS_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


class MissingInput(RuntimeError):
    """A stage this one reads from has not run."""


class EvaluationFailed(RuntimeError):
    """Requests failed outright, or vLLM never drafted (speculative decoding not engaged)."""


# -- metrics --------------------------------------------------------------------------------


def parse_spec_metrics(text: str) -> dict:
    """The spec-decode counters of a Prometheus text page, summed over label sets (engines).

    {"drafts", "draft_tokens", "accepted_tokens": float, "accepted_per_pos": [float per position],
    "found": whether any spec-decode counter was present}."""
    out = {name: 0.0 for name in COUNTERS.values()}
    per_pos: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, raw = match.groups()
        if name not in COUNTERS and name != PER_POSITION:
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        found = True
        if name in COUNTERS:
            out[COUNTERS[name]] += value
        else:
            pos = _POSITION.search(labels or "")
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    out["accepted_per_pos"] = [per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)] if per_pos else []
    out["found"] = found
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    """Counters of one measurement window, with the rates derived from them."""
    d = {k: after[k] - before[k] for k in COUNTERS.values()}
    n = max(len(before["accepted_per_pos"]), len(after["accepted_per_pos"]))
    pad = lambda xs: list(xs) + [0.0] * (n - len(xs))  # noqa: E731
    per = [a - b for a, b in zip(pad(after["accepted_per_pos"]), pad(before["accepted_per_pos"]))]
    drafts, draft_tokens, accepted = d["drafts"], d["draft_tokens"], d["accepted_tokens"]
    return {
        "drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "accepted_per_position": [int(x) for x in per],
        "per_position_acceptance": [x / drafts for x in per] if drafts else [None] * len(per),
    }


def fetch_metrics(client: httpx.Client, root_url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = client.get(f"{root_url}/metrics", headers=headers, timeout=METRICS_TIMEOUT)
    if response.status_code != 200:
        raise EvaluationFailed(f"{root_url}/metrics returned {response.status_code}: {response.text[:200]}")
    return parse_spec_metrics(response.text)


# -- prompts --------------------------------------------------------------------------------


def _order(sample_id: str) -> str:
    return hashlib.sha256(f"eagle3-evaluate-order:{sample_id}".encode()).hexdigest()


def select_prompts(run_dir: str | Path, fraction: float, num_prompts: int) -> tuple[list[dict], dict]:
    """Up to ``num_prompts`` held-out prompts (id, messages), topped up from the rest if needed."""
    import pyarrow.parquet as pq

    from eagle3.train.split import is_heldout

    folder = Path(run_dir) / "prompts"
    shards = sorted(folder.glob("shard-*.parquet"))
    if not shards:
        raise MissingInput(f"no prompt shards (shard-*.parquet) in {folder}: run the prepare stage first")
    rows, seen = [], set()
    for shard in shards:
        for row in pq.read_table(shard, columns=["id", "messages"]).to_pylist():
            if row["id"] not in seen:
                seen.add(row["id"])
                rows.append({"id": row["id"], "messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]})
    rows.sort(key=lambda r: _order(r["id"]))
    heldout = [r for r in rows if is_heldout(r["id"], fraction)]
    chosen = heldout[:num_prompts]
    top_up = [r for r in rows if not is_heldout(r["id"], fraction)][: num_prompts - len(chosen)]
    info = {
        "prompts_available": len(rows), "heldout_available": len(heldout), "heldout_used": len(chosen),
        "topped_up_from_training": len(top_up), "eval_fraction": fraction, "requested": num_prompts,
    }
    if top_up:
        info["note"] = (f"only {len(heldout)} held-out prompts exist (train.eval_fraction={fraction}); "
                        f"{len(top_up)} training prompts were added, which flatters acceptance")
    return chosen + top_up, info


# -- requests -------------------------------------------------------------------------------


def _one_request(client: httpx.Client, url: str, headers: dict, body: dict) -> tuple[str | None, int]:
    """(error kind or None, completion tokens)."""
    try:
        response = client.post(url, headers=headers, json=body)
    except httpx.TimeoutException:
        return "timeout", 0
    except httpx.HTTPError as exc:
        return type(exc).__name__, 0
    if response.status_code != 200:
        return f"http_{response.status_code}", 0
    try:
        data = response.json()
        if not isinstance(data["choices"][0]["message"], dict):
            return "bad_response", 0
        return None, int((data.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError):
        return "bad_response", 0


def run_requests(base_url: str, api_key: str | None, model: str, prompts: list[dict], *, temperature: float,
                 top_p: float, max_tokens: int, concurrency: int, timeout_s: float) -> dict:
    """Send every prompt once; counts of ok/failed by error kind and completion tokens."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    workers = max(1, min(concurrency, len(prompts)))
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    began = time.monotonic()
    with httpx.Client(timeout=timeout, limits=limits, trust_env=False) as client, ThreadPoolExecutor(workers) as pool:
        bodies = [{"model": model, "messages": p["messages"], "max_tokens": max_tokens, "temperature": temperature,
                   "top_p": top_p if temperature > 0 else 1.0} for p in prompts]
        outcomes = list(pool.map(lambda b: _one_request(client, f"{base_url}/chat/completions", headers, b), bodies))
    errors = Counter(kind for kind, _ in outcomes if kind)
    tokens = sum(n for _, n in outcomes)
    wall = time.monotonic() - began
    return {"requests": len(prompts), "requests_ok": len(prompts) - sum(errors.values()), "requests_failed": sum(errors.values()),
            "errors": dict(errors), "completion_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None}


def request_timeout_s(config: PipelineConfig) -> float:
    gen = config.generation
    if gen.request_timeout_s is not None:
        return gen.request_timeout_s
    return gen.deadline_base_s + config.evaluate.max_tokens / gen.min_tokens_per_s


def temperatures(config: PipelineConfig) -> list[float]:
    temps = config.evaluate.temperatures
    temps = [0.0, config.generation.temperature] if temps is None else temps
    return list(dict.fromkeys(float(t) for t in temps))


def speculative_config(drafter_dir: str | Path, num_speculative_tokens: int) -> str:
    return json.dumps({"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": num_speculative_tokens})


def live_acceptance(config: PipelineConfig, drafter_dir: str | Path, prompts: list[dict], *, log_path: str | Path,
                    temps: list[float] | None = None, logger=None) -> dict:
    """Serve the target with ``drafter_dir`` as its EAGLE-3 drafter and measure each temperature.

    Uses the managed-server settings (server.python/command, args, env) whatever server.mode
    says: the drafter is part of the server's command line, so this stage starts its own."""
    from eagle3.models import resolve_model, served_name, vllm_args, vllm_launcher
    from eagle3.serving.managed import ManagedServer

    log = logger or logging.getLogger(__name__)
    server, ev = config.server, config.evaluate
    if not prompts:
        raise ValueError("live_acceptance needs at least one prompt")
    if any(a.split("=", 1)[0] in ("--speculative-config", "--speculative_config", "-sc") for a in server.args):
        raise ValueError("server.args already sets --speculative-config; evaluate sets it to the exported drafter")
    if server.mode == "external":
        log.warning("evaluate starts its own vLLM server (server.python/command) even though server.mode=external")
    temps = temps if temps is not None else temperatures(config)
    model = resolve_model(server.model)
    name = served_name(server.model, model, server.served_model_name)
    command = vllm_launcher(server)
    extra = [*vllm_args(server, model), "--speculative-config", speculative_config(drafter_dir, ev.num_speculative_tokens)]
    managed = ManagedServer(command, model, served_model_name=name, host=server.host, extra_args=extra, env=dict(server.env),
                            log_path=log_path, startup_timeout_s=server.startup_timeout_s, stop_grace_s=server.stop_grace_s,
                            logger=log)
    began = time.monotonic()
    results = []
    with managed, httpx.Client(trust_env=False) as probe:
        started_s = time.monotonic() - began
        for temperature in temps:
            before = fetch_metrics(probe, managed.root_url, managed.api_key)
            sent = run_requests(managed.base_url, managed.api_key, name, prompts, temperature=temperature,
                                top_p=config.generation.top_p, max_tokens=ev.max_tokens,
                                concurrency=config.generation.concurrency, timeout_s=request_timeout_s(config))
            managed.check()
            after = fetch_metrics(probe, managed.root_url, managed.api_key)
            if not after["found"]:
                raise EvaluationFailed(f"{managed.root_url}/metrics has no spec-decode counters: is speculative decoding on?")
            row = {"temperature": temperature, **sent, **metrics_delta(before, after)}
            log.info("evaluate T=%g: %d/%d requests ok, drafts %d, accepted %d/%d draft tokens, mean acceptance length %s",
                     temperature, row["requests_ok"], row["requests"], row["drafts"], row["accepted_tokens"],
                     row["draft_tokens"], row["mean_acceptance_length"])
            results.append(row)
    return {"drafter": str(Path(drafter_dir).resolve()), "target": model, "served_model_name": name,
            "num_speculative_tokens": ev.num_speculative_tokens, "max_tokens": ev.max_tokens,
            "server_start_s": round(started_s, 1), "temperatures": results}


# -- the stage ------------------------------------------------------------------------------


def offline_estimate(run_dir: str | Path) -> dict | None:
    """The last line of training's held-out evaluation (RUN/train/eval.jsonl), if any."""
    path = Path(run_dir) / "train" / "eval.jsonl"
    if not path.exists():
        return None
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
        value = last.get("acceptance_length")
        return {"acceptance_length": float(value) if value is not None else None, "step": last.get("step"), "path": str(path)}
    except (ValueError, TypeError, AttributeError) as exc:
        return {"acceptance_length": None, "path": str(path), "error": f"last line unreadable: {exc}"}


def _untrained_baseline(config: PipelineConfig, drafter: Path, prompts: list[dict], out: Path, logger) -> dict:
    """The same measurement at temperature 0 for an untrained drafter with the trained one's draft
    vocabulary and aux layers (random layer weights, embeddings and lm_head rows from the target)."""
    import numpy as np
    from safetensors import safe_open

    from eagle3.export.layouts import export_checkpoint, write_untrained_checkpoint
    from eagle3.models import resolve_model

    target = resolve_model(config.server.model)
    exported = read_json(drafter / "config.json")
    layers = exported.get("eagle_aux_hidden_state_layer_ids") or exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with safe_open(str(drafter / "model.safetensors"), framework="np") as fh:  # the export ships d2t only for a smaller draft vocab
        d2t = fh.get_tensor("d2t") if "d2t" in fh.keys() else None
    draft_ids = None if d2t is None else (np.arange(len(d2t)) + d2t).tolist()
    ckpt = write_untrained_checkpoint(target, out / "untrained" / "checkpoint", draft_ids=draft_ids, aux_layer_ids=list(layers), seed=config.train.seed + 1)
    folder = export_checkpoint(ckpt, target, out / "untrained", ["vllm"], num_speculative_tokens=config.evaluate.num_speculative_tokens)["vllm"]
    return live_acceptance(config, folder, prompts, log_path=out / "server-untrained.log", temps=[0.0], logger=logger)


def run_evaluate(config: PipelineConfig, logger=None) -> dict:
    """Measure RUN/export/vllm live; write RUN/evaluate/live.json and the manifest entry."""
    run = Path(config.run_dir)
    drafter = run / "export" / "vllm"
    if not (drafter / "config.json").exists():
        raise MissingInput(f"{drafter} holds no exported drafter: run the export stage first (export.formats must include vllm)")
    out = run / "evaluate"
    prompts, selection = select_prompts(run, config.train.eval_fraction, config.evaluate.num_prompts)
    if selection.get("note"):
        (logger or logging.getLogger(__name__)).warning("evaluate: %s", selection["note"])
    live = live_acceptance(config, drafter, prompts, log_path=out / "server.log", logger=logger)
    untrained = _untrained_baseline(config, drafter, prompts, out, logger) if config.evaluate.compare_untrained else None
    info_path = drafter / "export_info.json"
    doc = {
        **live, "untrained": untrained, "selection": selection, "prompt_ids": [p["id"] for p in prompts],
        "export_info": read_json(info_path) if info_path.exists() else None,
        "offline_estimate": offline_estimate(run), "evaluate_config": config.evaluate.model_dump(mode="json"),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(out / "live.json", doc)
    rows = live["temperatures"]
    errors = Counter()
    for row in rows:
        errors.update(row["errors"])
    bad = [f"T={r['temperature']:g}: " + ("no request succeeded" if not r["requests_ok"] else "vLLM made no drafts")
           for r in rows if not r["requests_ok"] or not r["drafts"]]
    counts = StageCounts(sum(r["requests"] for r in rows), sum(r["requests_ok"] for r in rows),
                         sum(r["requests_failed"] for r in rows), 0, dict(errors))
    entry = record_stage(
        run, STAGE, counts, status="failed" if bad else "ok", error="; ".join(bad) or None, path=str(out / "live.json"),
        mean_acceptance_length={f"{r['temperature']:g}": r["mean_acceptance_length"] for r in rows},
        acceptance_rate={f"{r['temperature']:g}": r["acceptance_rate"] for r in rows},
        offline_acceptance_length=(doc["offline_estimate"] or {}).get("acceptance_length"), selection=selection,
        untrained_mean_acceptance_length=({f"{r['temperature']:g}": r["mean_acceptance_length"] for r in untrained["temperatures"]} if untrained else None),
        config_hash=section_hash(config.evaluate), versions=versions("httpx"),
    )
    if bad:
        raise EvaluationFailed(f"evaluate: {'; '.join(bad)}; see {out / 'live.json'} and {out / 'server.log'}")
    return {**entry, "live": doc}
