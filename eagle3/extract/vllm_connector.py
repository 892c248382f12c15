"""A hidden-states KV connector for vLLM that writes synchronously (works on the CPU build).

Runs inside the vLLM venv only; the pipeline never imports it. vLLM loads it by module
path (``kv_connector_module_path="vllm_connector"``), so ``vllm_worker.py`` puts this
folder on ``sys.path`` and ``PYTHONPATH`` before building the engine.

vLLM's ``extract_hidden_states`` speculative method stores the target's aux hidden
states for every scheduled token in a cache-only KV layer shaped
``[num_blocks, num_layers, block_size, hidden]``. The stock
``ExampleHiddenStatesConnector`` copies a finished request's blocks out with CUDA
streams, events and pinned memory, which fails on a CPU-only torch
(``pin_memory=True requires a CUDA ...``). This subclass keeps its scheduler side
(which blocks to save, where, and delaying the blocks' release until saved) and
replaces the worker side: the copy and the file write happen right away, in the
engine's own thread, and each file appears atomically (temporary name, fsync,
``os.replace``) so a reader polling for it never sees a partial file.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

CONNECTOR_NAME = "SyncHiddenStatesConnector"


def gather_slots(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """Rows ``[num_tokens, num_layers, hidden]`` of a request from the cache-only layer.

    ``cache`` is ``[num_blocks, num_layers, block_size, hidden]``; the request's tokens
    fill its blocks in order, ``block_size`` tokens per block.
    """
    block_size = cache.shape[2]
    needed = -(-num_tokens // block_size)
    if needed > len(block_ids):
        raise RuntimeError(
            f"request has {num_tokens} tokens but only {len(block_ids)} hidden-state blocks "
            f"of {block_size} (needs {needed})"
        )
    blocks = torch.tensor(block_ids[:needed], dtype=torch.long, device=cache.device)
    # [needed, layers, block_size, hidden] -> [needed, block_size, layers, hidden]
    picked = cache.index_select(0, blocks).permute(0, 2, 1, 3)
    return picked.reshape(-1, cache.shape[1], cache.shape[3])[:num_tokens]


def write_atomically(tensors: dict[str, torch.Tensor], path: str) -> None:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        save_file(tensors, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, device-agnostic worker side."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # Files are complete when they appear (os.replace), so no flock companions.
        self.use_lock = False
        self._saved: set[str] = set()
        self._finished_seen: set[str] = set()

    def wait_for_save(self) -> None:
        return None

    def _save_now(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-states cache was never registered with the connector")
        num_tokens = int(pending.token_ids.shape[0])
        rows = gather_slots(self._kv_cache, list(pending.block_ids), num_tokens)
        tensors = {
            "hidden_states": rows.to("cpu").contiguous().clone(),
            "token_ids": pending.token_ids.to(torch.int64).contiguous().clone(),
        }
        write_atomically(tensors, pending.filename)
        self._saved.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._save_now(pending)
        self._finished_seen.update(finished_req_ids)
        done = self._finished_seen & self._saved
        if not self._is_tp_rank_zero:
            # Other ranks save nothing; the finished count is 1 (rank 0's report).
            self._finished_seen.clear()
            return None, None
        self._finished_seen -= done
        self._saved -= done
        return (done or None), None

    def shutdown(self) -> Any:
        try:
            self._executor.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        parent = getattr(super(), "shutdown", None)
        return parent() if callable(parent) else None
