"""The vLLM backend's chunk hand-over (``stream_with_vllm``), against a stand-in worker that speaks
the same file protocol as ``vllm_worker.py`` (the real worker runs in
tests/integration/test_extract_vllm.py): every chunk arrives in order, one worker for all of them,
and a worker that dies, hangs or is abandoned is reported or stopped, never waited on for ever."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import numpy as np
import pytest

from eagle3.extract.vllm_backend import VllmExtractError, stream_with_vllm

# The worker side of the protocol: chunk c goes to OUTPUT-stem.{c:05d}.safetensors once chunk
# c - 1 has been taken. FAULT: "die-after-1" exits 3 after chunk 1; "hang" never writes chunk 2.
STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    from safetensors.numpy import save_file

    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(request["output"])
    Path(os.environ.get("PID_AT") or out.parent / "worker.pid").write_text(str(os.getpid()))
    fault = os.environ.get("FAULT", "")
    start, H, L = 0, 4, len(request["layer_ids"])
    for c, size in enumerate(request["chunks"]):
        if c == 1 and fault == "hang":
            time.sleep(600)
        time.sleep(float(os.environ.get("CHUNK_S") or 0))  # the forward's time
        samples = request["samples"][start : start + size]
        start += size
        tensors = {}
        for k, s in enumerate(samples):
            ids = np.array(s["input_ids"], dtype=np.int64)
            tensors[f"h.{k}"] = np.repeat(ids[:, None, None], L * H, axis=1).reshape(len(ids), L, H).astype(np.float32)
            tensors[f"ids.{k}"] = ids
        if c > 0:
            prev = out.with_name(f"{out.stem}.{c - 1:05d}{out.suffix}")
            while prev.exists():
                time.sleep(0.01)
        tmp = out.with_name(f".tmp-{c}")
        save_file(tensors, str(tmp))
        os.replace(tmp, out.with_name(f"{out.stem}.{c:05d}{out.suffix}"))
        print(f"wrote chunk {c}", file=sys.stderr, flush=True)
        if c == 1 and fault == "die-after-1":
            print("stand-in: dying", file=sys.stderr, flush=True)
            sys.exit(3)
    """
)


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "stand_in_worker.py"
    script.write_text(STAND_IN)
    return script


def _samples(n: int = 5):
    return [(f"s{k}", list(range(k + 1, k + 4 + k))) for k in range(n)]


def _stream(worker_script, tmp_path, monkeypatch, fault: str = "", timeout_s: float = 60, chunks=(2, 2, 1)):
    import eagle3.extract.vllm_backend as backend

    monkeypatch.setattr(backend, "WORKER", worker_script)
    return stream_with_vllm(
        sys.executable, "m", [1, 2, 3, 4], _samples(), list(chunks), tmp_path / "work", timeout_s, env={"FAULT": fault}
    )


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_every_chunk_arrives_in_order_from_one_worker_and_nothing_is_left(worker, tmp_path, monkeypatch):
    got = list(_stream(worker, tmp_path, monkeypatch))
    assert [sorted(c) for c in got] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    for chunk in got:
        for sample_id, states in chunk.items():
            ids = dict(_samples())[sample_id]
            assert states.shape == (len(ids), 4, 4) and np.array_equal(states[:, 2, 1], ids)
    work = tmp_path / "work"
    assert not list(work.glob("vllm_hidden_states*.safetensors")), "each chunk file is removed once taken"
    assert _gone(int((work / "worker.pid").read_text())), "one worker, finished"


def test_a_worker_that_dies_mid_shard_is_an_error_with_its_last_words(worker, tmp_path, monkeypatch):
    stream = _stream(worker, tmp_path, monkeypatch, fault="die-after-1")
    assert sorted(next(stream)) == ["s0", "s1"]
    assert sorted(next(stream)) == ["s2", "s3"]
    with pytest.raises(VllmExtractError, match=r"failed \(exit 3\)(.|\n)*stand-in: dying"):
        next(stream)


def test_a_chunk_past_its_deadline_kills_the_worker_and_names_the_chunk(worker, tmp_path, monkeypatch):
    stream = _stream(worker, tmp_path, monkeypatch, fault="hang", timeout_s=3)
    next(stream)
    pid = int((tmp_path / "work" / "worker.pid").read_text())
    with pytest.raises(VllmExtractError, match="3 s timeout on chunk 2 of 3"):
        next(stream)
    assert _gone(pid)


def test_a_caller_that_stops_early_stops_the_worker(worker, tmp_path, monkeypatch):
    stream = _stream(worker, tmp_path, monkeypatch)
    next(stream)
    pid = int((tmp_path / "work" / "worker.pid").read_text())
    stream.close()  # the stage failed storing a chunk: the worker must not wait for ever
    assert _gone(pid)


def test_chunks_that_do_not_cover_the_samples_are_refused(worker, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="add up to the 5 samples"):
        next(_stream(worker, tmp_path, monkeypatch, chunks=(2, 2)))


def test_the_stage_stops_the_worker_when_storing_a_chunk_fails(worker, tmp_path, monkeypatch):
    """The stage closes the stream in its own cleanup: the worker stops at once, not when the failure's
    traceback lets go of the generator (until then a CPU worker would wait for its chunk to be taken)."""
    import logging
    import types

    import eagle3.extract.vllm_backend as backend
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.extract import stage

    monkeypatch.setattr(backend, "WORKER", worker)
    monkeypatch.setenv("PID_AT", str(tmp_path / "worker.pid"))
    monkeypatch.setenv("CHUNK_S", "1")
    sets = [f'run_dir="{tmp_path / "run"}"', "extract.vllm_chunk_tokens=8", f'server.python="{sys.executable}"']
    config = load_config(DEMO_RECIPE, sets)

    class DiskGone:
        def write(self, k, aux, last):
            raise OSError("disk gone")

    ids, seqs = zip(*_samples())
    with pytest.raises(OSError, match="disk gone") as failure:  # held, as a task runner holds it to log and retry
        stage._fill_with_vllm(
            config, "shard-00000.parquet", list(ids), [np.array(s) for s in seqs],
            types.SimpleNamespace(layer_ids=[1, 2, 3], num_layers=4, model_path="m"), DiskGone(),
            logging.getLogger("test"),
        )  # fmt: skip
    assert _gone(int((tmp_path / "worker.pid").read_text()), within_s=0.5), "stopped, not left computing"
    assert failure.value.__traceback__ is not None
