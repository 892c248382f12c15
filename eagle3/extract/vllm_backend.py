"""Hidden states through vLLM's own extraction route, driven from the pipeline venv.

The pipeline venv has no vllm: this module writes a request file, runs
``vllm_worker.py`` (beside this file) with the vLLM venv's python under a deadline,
streams the worker's output to a logger and reads back the one safetensors file it
writes. Only numpy, safetensors, the standard library and eagle3's durable writes and
process helpers (the worker group dies with this process; it inherits no credential) are used here.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from eagle3.durable import atomic_write_json
from eagle3.errors import TransientError
from eagle3.secret_env import child_env

logger = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
REQUEST_NAME = "vllm_hidden_request.json"
OUTPUT_NAME = "vllm_hidden_states.safetensors"
PIDFILE_NAME = "vllm_worker.pid"
TAIL_LINES = 20
KILL_GRACE_S = 10.0
POLL_S = 0.05  # how often a chunked run looks for the worker's next chunk file


class VllmExtractError(TransientError, RuntimeError):
    """The vLLM worker failed, timed out, or wrote something unusable."""


def extract_with_vllm(
    python: str,
    model: str,
    layer_ids: list[int],
    samples: list[tuple[str, list[int]]],
    work_dir: Path,
    timeout_s: float,
    env: dict | None = None,
    log=None,
    *,
    max_model_len: int | None = None,
    engine_args: dict | None = None,
    drop_env: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """Hidden states of ``samples`` as ``{id: float32 [T, len(layer_ids), H]}``.

    ``layer_ids`` use vLLM's aux numbering (id ``i`` = output of decoder layer ``i-1``;
    the layer count = the last layer's output before the final norm). ``python`` is the
    vLLM venv's interpreter; ``env`` adds to this process's environment (e.g.
    ``VLLM_CPU_KVCACHE_SPACE``), which the worker gets less its credentials (eagle3/secret_env.py;
    ``drop_env`` names more: the config's server.api_key_env). ``max_model_len`` defaults to the longest sample plus
    the one generated token; ``engine_args`` are extra ``vllm.LLM`` keyword arguments.
    Raises ``VllmExtractError`` with the worker's last output lines on any failure.
    """
    log = log or logger
    output, request_path = _write_request(model, layer_ids, samples, work_dir, max_model_len, engine_args)
    argv = [python, str(WORKER), str(request_path)]
    tail = run_worker(argv, env, timeout_s, log, pidfile=work_dir / PIDFILE_NAME, drop_env=drop_env)
    if not output.exists():
        raise VllmExtractError(f"vLLM worker exited cleanly but wrote no {output}" + render(tail))
    return read_output(output, samples, len(layer_ids), tail)


def stream_with_vllm(
    python: str,
    model: str,
    layer_ids: list[int],
    samples: list[tuple[str, list[int]]],
    chunks: list[int],
    work_dir: Path,
    timeout_s: float,
    env: dict | None = None,
    log=None,
    *,
    max_model_len: int | None = None,
    engine_args: dict | None = None,
    drop_env: tuple[str, ...] = (),
) -> Iterator[dict[str, np.ndarray]]:
    """``extract_with_vllm`` over ``samples`` in chunks (``chunks``: sample counts, in order) with
    one worker, so vLLM starts once: yields each chunk's ``{id: float32 [T, len(layer_ids), H]}``
    as the worker finishes it; its file is removed when the caller asks for the next one. On a GPU
    the worker computes the next chunk while the caller stores this one (it writes a chunk only once
    the previous file is gone); on the CPU it waits for that before computing, since the two would
    share the cores (measured on 2 cores: 28.5 s a shard overlapped, 14.6 s not). Memory and disk
    hold about two chunks. ``timeout_s`` bounds each chunk (the first includes starting vLLM); on a
    failure, a deadline or the caller stopping early, the worker group is stopped."""
    from eagle3 import proc

    log = log or logger
    if sum(chunks) != len(samples) or any(n <= 0 for n in chunks):
        raise ValueError(f"chunks {chunks} must be positive and add up to the {len(samples)} samples")
    output, request_path = _write_request(
        model, layer_ids, samples, work_dir, max_model_len, engine_args, chunks=list(chunks)
    )
    for stale in output.parent.glob(f"{output.stem}.*{output.suffix}"):
        stale.unlink()
    worker = proc.Child(
        [python, str(WORKER), str(request_path)],
        name="vLLM worker",
        logger=log,
        env=_worker_env(env, drop_env),
        pidfile=work_dir / PIDFILE_NAME,
        grace_s=KILL_GRACE_S,
        prefix="vllm:",
        tail_lines=TAIL_LINES,
    )
    try:
        worker.start()
    except OSError as exc:
        raise VllmExtractError(f"cannot start the vLLM worker with {python}: {exc}") from exc
    began = time.monotonic()
    try:
        start = 0
        for c, size in enumerate(chunks):
            path = _chunk_path(output, c)
            deadline = time.monotonic() + timeout_s
            while not path.exists():
                if worker.poll() is not None and not path.exists():
                    worker.join_output(5.0)
                    code = worker.returncode
                    why = f"failed (exit {code})" if code else f"exited before writing chunk {c + 1} of {len(chunks)}"
                    raise VllmExtractError(f"vLLM worker {why}" + render(worker.tail()))
                if time.monotonic() > deadline:
                    worker.stop()
                    raise VllmExtractError(
                        f"vLLM worker exceeded its {timeout_s:g} s timeout on chunk {c + 1} of {len(chunks)} and was "
                        "killed" + render(worker.tail())
                    )
                time.sleep(POLL_S)
            states = read_output(path, samples[start : start + size], len(layer_ids), worker.tail())
            start += size
            yield states
            path.unlink()  # taken and stored: the worker may write the next chunk (on a CPU, start it)
        try:
            code = worker.wait(timeout_s)
        except proc.DeadlineExceeded as exc:
            raise VllmExtractError(
                f"vLLM worker did not exit within {timeout_s:g} s of its last chunk and was killed" + render(exc.tail)
            ) from None
        worker.join_output(5.0)
        if code != 0:
            raise VllmExtractError(f"vLLM worker failed (exit {code}) after its last chunk" + render(worker.tail()))
        log.info("vLLM worker finished in %.1f s (exit 0, %d chunks)", time.monotonic() - began, len(chunks))
    finally:
        if worker.poll() is None:
            worker.stop()
        else:
            worker.stop(proc.LEFTOVER_GRACE_S)


def _chunk_path(output: Path, chunk: int) -> Path:
    """The worker's name for a chunk's file (vllm_worker.chunk_path)."""
    return output.with_name(f"{output.stem}.{chunk:05d}{output.suffix}")


def _write_request(
    model, layer_ids, samples, work_dir, max_model_len, engine_args, chunks: list[int] | None = None
) -> tuple[Path, Path]:
    ids = [sample_id for sample_id, _ in samples]
    if not samples:
        raise ValueError("no samples to extract")
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids must be unique")
    if not layer_ids:
        raise ValueError("layer_ids must not be empty")
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    output = work_dir / OUTPUT_NAME
    if output.exists():
        output.unlink()
    longest = max(len(tokens) for _, tokens in samples)
    request = {
        "model": str(model),
        "layer_ids": [int(i) for i in layer_ids],
        "samples": [{"id": sample_id, "input_ids": [int(t) for t in tokens]} for sample_id, tokens in samples],
        "output": str(output.absolute()),
        "max_model_len": int(max_model_len or longest + 1),
    }
    if engine_args:
        request["engine_args"] = dict(engine_args)
    if chunks is not None:
        request["chunks"] = chunks
    request_path = work_dir / REQUEST_NAME
    atomic_write_json(request_path, request)
    return output, request_path


def render(tail) -> str:
    lines = list(tail)
    return ("\n--- last vLLM worker output ---\n" + "\n".join(lines)) if lines else ""


def run_worker(
    command: list[str],
    env: dict | None,
    timeout_s: float,
    log,
    pidfile: Path | None = None,
    drop_env: tuple[str, ...] = (),
) -> collections.deque:
    """Run the worker in its own process group (eagle3/proc.py); return its last output lines.

    Each output line is forwarded to ``log``. The group dies with this process even when it is
    SIGKILLed; with ``pidfile``, a worker group that a killed earlier run left behind (guard gone
    too) is stopped before this one starts.
    """
    from eagle3 import proc

    full_env = _worker_env(env, drop_env)
    began = time.monotonic()
    try:
        worker = proc.run(
            command,
            timeout_s=timeout_s,
            name="vLLM worker",
            logger=log,
            env=full_env,
            pidfile=pidfile,
            grace_s=KILL_GRACE_S,
            prefix="vllm:",
            tail_lines=TAIL_LINES,
        )
    except OSError as exc:
        raise VllmExtractError(f"cannot start the vLLM worker with {command[0]}: {exc}") from exc
    except proc.DeadlineExceeded as exc:
        raise VllmExtractError(
            f"vLLM worker exceeded its {timeout_s:g} s timeout and was killed" + render(exc.tail)
        ) from None
    tail = collections.deque(worker.tail(), maxlen=TAIL_LINES)
    log.info("vLLM worker finished in %.1f s (exit %s)", time.monotonic() - began, worker.returncode)
    if worker.returncode != 0:
        raise VllmExtractError(f"vLLM worker failed (exit {worker.returncode})" + render(tail))
    return tail


def _worker_env(env: dict | None, drop_env: tuple[str, ...] = ()) -> dict:
    full_env = child_env(drop=drop_env)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    return full_env


def read_output(path: Path, samples, n_layers: int, tail) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        data = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - any read failure is a bad output
        raise VllmExtractError(f"cannot read the vLLM worker's output {path}: {exc}" + render(tail)) from exc
    result: dict[str, np.ndarray] = {}
    for k, (sample_id, tokens) in enumerate(samples):
        states, seen = data.get(f"h.{k}"), data.get(f"ids.{k}")
        if states is None or seen is None:
            raise VllmExtractError(f"{path} lacks h.{k}/ids.{k} (sample {sample_id!r})" + render(tail))
        if states.ndim != 3 or states.shape[0] != len(tokens) or states.shape[1] != n_layers:
            raise VllmExtractError(
                f"sample {sample_id!r}: states shaped {states.shape}, expected "
                f"[{len(tokens)}, {n_layers}, H]" + render(tail)
            )
        if not np.array_equal(seen.astype(np.int64), np.asarray(tokens, dtype=np.int64)):
            raise VllmExtractError(f"sample {sample_id!r}: vLLM saw different token ids" + render(tail))
        result[sample_id] = np.ascontiguousarray(states, dtype=np.float32)
    return result
