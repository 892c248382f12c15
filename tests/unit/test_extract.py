"""Hidden-state extraction: layer convention, padding, storage, resume, online == offline, disk refusal."""

import json
from pathlib import Path

import pytest
import torch

from eagle3.config import DEMO_RECIPE, load_config
from eagle3.extract.errors import (
    DiskSpaceError,
    ExtractInputError,
    LayerIdError,
    StatesError,
)
from eagle3.extract.hf import HFExtractor, length_batches
from eagle3.extract.store import ShardStates, StatesWriter
from eagle3.models import default_layer_ids, resolve_layer_ids
from eagle3.run_facts import RunFacts
from eagle3.tiny import ensure_tiny
from extract_runs import LENGTHS, make_run, samples


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny("qwen3"))


@pytest.fixture(scope="module")
def extractor(tiny) -> HFExtractor:
    return HFExtractor(tiny, None, "float32")


def direct(model, ids: list[int], layer_ids: list[int]):
    """One sample alone, through HF's own outputs: hidden_states[i] for the aux ids and the
    final norm's input for the last layer (what vLLM takes)."""
    caught = {}
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: caught.__setitem__("pre_norm", args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return {i: out.hidden_states[i][0] for i in layer_ids}, caught["pre_norm"][0], out.hidden_states[-1][0]


def test_default_layer_ids_stay_distinct_for_small_targets():
    assert default_layer_ids(32) == [2, 16, 29]  # vLLM's own choice where it is distinct
    assert default_layer_ids(4) == [1, 2, 3]  # vLLM's (2, 2, 1) would collapse
    assert len(set(default_layer_ids(5))) == 3
    with pytest.raises(LayerIdError, match="set extract.layer_ids"):
        default_layer_ids(2)
    with pytest.raises(LayerIdError, match=r"\[5\] outside 1..4"):
        resolve_layer_ids([1, 2, 5], 4)


def test_config_rejects_layer_ids_that_are_not_three_distinct():
    from eagle3.config import ConfigError

    with pytest.raises(ConfigError, match="layer_ids"):
        load_config(DEMO_RECIPE, ["extract.layer_ids=[1, 1, 2]"])


def test_length_batches_cover_every_sample_once_within_the_token_budget():
    lengths = [5, 100, 3, 60, 60, 7, 300, 1]
    batches = length_batches(lengths, 128)
    assert sorted(k for b in batches for k in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[k] for k in b) <= 128


def test_states_equal_a_direct_forward_per_layer_and_padding_never_leaks(extractor):
    batch = samples()
    out = extractor.states(batch)  # one padded batch of five different lengths
    H = extractor.hidden_size
    for ids, (aux, last) in zip(batch, out):
        assert aux.shape == (len(ids), 3 * H) and last.shape == (len(ids), H)
        per_layer, pre_norm, post_norm = direct(extractor.model, ids, extractor.layer_ids)
        for j, i in enumerate(extractor.layer_ids):
            torch.testing.assert_close(aux[:, j * H : (j + 1) * H], per_layer[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last, pre_norm, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(last, post_norm, atol=1e-2), "the last state must be taken before the final norm"


def test_writer_round_trip_out_of_order_and_loadable_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    H, lengths = 8, [3, 5, 2]
    data = [(torch.randn(n, 3 * H), torch.randn(n, H)) for n in lengths]
    path = tmp_path / "s.safetensors"
    with StatesWriter(path, lengths, H, {"model": "m"}) as w:
        for k in (2, 0, 1):
            w.write(k, *data[k])
        w.commit()
    loaded = load_file(str(path))  # the stock reader accepts the hand-written header
    assert loaded["aux"].dtype == torch.bfloat16 and loaded["aux"].shape == (10, 3 * H)
    assert loaded["offsets"].tolist() == [0, 3, 8, 10]
    states = ShardStates(path)
    assert len(states) == 3 and states.metadata["model"] == "m"
    for k, (aux, last) in enumerate(data):
        a, b = states.sample(k)
        assert torch.equal(a, aux.to(torch.bfloat16)) and torch.equal(b, last.to(torch.bfloat16))


def test_writer_refuses_holes_bad_shapes_and_non_finite_values(tmp_path):
    H = 4
    path = tmp_path / "s.safetensors"
    w = StatesWriter(path, [2, 2], H)
    with pytest.raises(StatesError, match=r"sample 0 expects aux \[2, 12\]"):
        w.write(0, torch.zeros(3, 12), torch.zeros(3, 4))
    for bad in (float("nan"), float("inf"), float("-inf")):
        aux = torch.zeros(2, 12)
        aux[1, 7] = bad
        with pytest.raises(StatesError, match="non-finite"):
            w.write(0, aux, torch.zeros(2, 4))
        with pytest.raises(StatesError, match="non-finite"):
            w.write(0, torch.zeros(2, 12), aux[:, 4:8])
    with pytest.raises(StatesError, match="non-finite"):  # finite in float32, past bf16's range once stored
        w.write(0, torch.full((2, 12), 3.4e38), torch.zeros(2, 4))
    w.write(0, torch.zeros(2, 12), torch.zeros(2, 4))
    with pytest.raises(StatesError, match="1 samples were never written"):
        w.commit()
    assert not path.exists() and not list(tmp_path.iterdir()), "no final file and no temp file left behind"


def _padded(data, lengths, order):
    """``data``'s samples in ``order`` as one right-padded batch, the padding filled with noise."""
    longest = max(lengths[k] for k in order)
    width_aux, width_last = data[0][0].shape[1], data[0][1].shape[1]
    aux, last = torch.randn(len(order), longest, width_aux), torch.randn(len(order), longest, width_last)
    for b, k in enumerate(order):
        aux[b, : lengths[k]], last[b, : lengths[k]] = data[k]
    return aux, last


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
def test_a_batch_written_whole_gives_the_same_bytes_as_sample_by_sample(tmp_path, storage):
    H, lengths = 8, [3, 5, 2, 4]
    data = [(torch.randn(n, 3 * H) * (k + 1), torch.randn(n, H)) for k, n in enumerate(lengths)]
    one, whole = tmp_path / "one.safetensors", tmp_path / "whole.safetensors"
    with StatesWriter(one, lengths, H, {"model": "m"}, storage) as w:
        for k in range(len(lengths)):
            w.write(k, *data[k])
        w.commit()
    with StatesWriter(whole, lengths, H, {"model": "m"}, storage) as w:
        w.write_batch([1, 3], *_padded(data, lengths, [1, 3]))  # out of order, padded to 5 rows
        w.write_batch([2, 0], *_padded(data, lengths, [2, 0]))
        w.commit()
    assert whole.read_bytes() == one.read_bytes()


def test_a_batch_with_non_finite_padding_is_stored_and_a_non_finite_sample_is_named(tmp_path):
    H, lengths = 4, [2, 3]
    data = [(torch.randn(n, 3 * H), torch.randn(n, H)) for n in lengths]
    w = StatesWriter(tmp_path / "s.safetensors", lengths, H)
    aux, last = _padded(data, lengths, [1, 0])
    aux[1, 2, 0] = float("nan")  # sample 0 has 2 rows: row 2 is padding
    last[1, 2, 1] = float("inf")
    w.write_batch([1, 0], aux, last)
    w.commit()
    got = ShardStates(tmp_path / "s.safetensors").sample(0)
    assert torch.equal(got[0], data[0][0].to(torch.bfloat16)) and torch.equal(got[1], data[0][1].to(torch.bfloat16))
    w = StatesWriter(tmp_path / "t.safetensors", lengths, H)
    aux, last = _padded(data, lengths, [0, 1])
    last[1, 2, 3] = float("nan")  # sample 1's last row
    with pytest.raises(StatesError, match="sample 1 has non-finite"):
        w.write_batch([0, 1], aux, last)
    with pytest.raises(StatesError, match=r"expects aux \[2, 3, 12\], got \[2, 3, 8\]"):
        w.write_batch([0, 1], aux[:, :, :8], last)
    with pytest.raises(StatesError, match="sample 1 has 3 tokens but its batch only 2"):
        w.write_batch([0, 1], aux[:, :2], last[:, :2])
    w.abort()


def test_writes_behind_a_thread_return_every_result_and_raise_a_writes_error():
    from eagle3.extract.stage import WRITE_AHEAD, _writes

    seen = []
    with _writes(True, "s") as submit:
        for k in range(7):
            seen += submit(lambda k=k: k)
            assert len(seen) >= k - WRITE_AHEAD  # never more than WRITE_AHEAD waiting
        seen += submit(None)
    assert sorted(seen) == list(range(7))

    def fail():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"), _writes(True, "s") as submit:
        for _ in range(WRITE_AHEAD + 2):
            submit(fail)
    with _writes(False, "s") as submit:
        assert submit(lambda: 3) == [3] and submit(None) == []


def run_stage(config, names):
    from eagle3.extract.stage import check_disk, extract_shard, plan

    the_plan = plan(RunFacts.resolve(config), names)
    check_disk(config, the_plan)
    return the_plan, [extract_shard(config, s, the_plan) for s in names]


def test_stage_stores_what_a_direct_forward_gives_and_resumes(tmp_path, extractor):
    config, names = make_run(tmp_path)
    the_plan, results = run_stage(config, names)
    assert [r.ok for r in results] == [5, 2] and not any(r.skipped for r in results)
    out = Path(config.run_dir) / "hidden_states"
    index = json.loads((out / "shard-00000.index.json").read_text())
    assert (
        index["ids"] == [f"s0-{k}" for k in range(5)]
        and index["num_tokens"] == list(LENGTHS)
        and index["layer_ids"] == [1, 2, 3]
    )
    states, H = ShardStates(out / "shard-00000.safetensors"), extractor.hidden_size
    for k, ids in enumerate(samples(LENGTHS, seed=0)):
        aux, last = states.sample(k)
        per_layer, pre_norm, _ = direct(extractor.model, ids, [1, 2, 3])
        for j in range(3):
            torch.testing.assert_close(
                aux[:, j * H : (j + 1) * H].float(), per_layer[j + 1], rtol=1e-2, atol=1e-2
            )  # bf16 storage
        torch.testing.assert_close(last.float(), pre_norm, rtol=1e-2, atol=1e-2)

    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    _, again = run_stage(config, names)
    assert all(r.skipped for r in again), "same inputs: nothing is extracted again"
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == before

    (out / "shard-00001.safetensors").unlink()
    _, third = run_stage(config, names)
    assert [r.skipped for r in third] == [True, False], "a shard whose states are gone is extracted again"

    changed = config.model_copy(update={"extract": config.extract.model_copy(update={"layer_ids": [1, 3, 4]})})
    _, fourth = run_stage(changed, names)
    assert not any(r.skipped for r in fourth), "new layer ids: every shard again"


def test_a_killed_extraction_leaves_no_complete_looking_shard(tmp_path, monkeypatch):
    from eagle3.extract import store

    config, names = make_run(tmp_path)
    real, calls = store.StatesWriter._pwrite_bytes, {"n": 0}

    def dies_after_three(self, data, at):  # killed in the middle of a batch's writes
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        calls["n"] += 1
        return real(self, data, at)

    monkeypatch.setattr(store.StatesWriter, "_pwrite_bytes", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_stage(config, names)
    out = Path(config.run_dir) / "hidden_states"
    assert not (out / "shard-00000.safetensors").exists() and not (out / "shard-00000.done.json").exists()
    assert not list(out.glob(".*partial")), "the partial file is removed"
    monkeypatch.setattr(store.StatesWriter, "_pwrite_bytes", real)
    _, results = run_stage(config, names)
    assert [r.ok for r in results] == [5, 2]


def test_online_extraction_gives_the_stored_tensors(tmp_path, extractor):
    config, names = make_run(tmp_path)
    run_stage(config, names)
    states = ShardStates(Path(config.run_dir) / "hidden_states" / "shard-00000.safetensors")
    seqs = samples(LENGTHS, seed=0)
    # Training's online path: the same extractor function on a training batch, cast to the stored dtype.
    from eagle3.extract.hf import cached_extractor

    online = cached_extractor(extractor.model_path, [1, 2, 3], "float32")
    for batch in ([0, 1, 2], [3, 4]):
        for k, (aux, last) in zip(batch, online.states([seqs[k] for k in batch])):
            a, b = states.sample(k)
            torch.testing.assert_close(aux.to(torch.bfloat16), a, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(last.to(torch.bfloat16), b, rtol=1e-2, atol=1e-2)


def test_disk_refusal_names_both_numbers(tmp_path, monkeypatch):
    import shutil

    from eagle3.extract import stage

    config, names = make_run(tmp_path)
    monkeypatch.setattr(stage.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    need = int((sum(LENGTHS) + 42) * 4 * 128 * 2 * stage.DISK_MARGIN)
    with pytest.raises(DiskSpaceError) as err:
        run_stage(config, names)
    assert f"need 0.00 GiB ({need} bytes)" in str(err.value) and "only 0.00 GiB (1000 bytes) free" in str(err.value)
    assert not (Path(config.run_dir) / "hidden_states" / "shard-00000.safetensors").exists()


def test_missing_tokenized_shard_is_named(tmp_path):
    config, names = make_run(tmp_path)
    (Path(config.run_dir) / "tokenized" / "shard-00001.done.json").unlink()
    with pytest.raises(ExtractInputError, match="shard-00001.done.json not found.*eagle3 tokenize"):
        run_stage(config, names)


def test_online_mode_stores_nothing_and_records_the_settings_training_uses(tmp_path):
    from eagle3.extract.stage import online_results, plan, record, write_online

    config, names = make_run(tmp_path, (LENGTHS, (12, 30)), 'extract.mode="online"')
    the_plan = plan(RunFacts.resolve(config), names)
    settings = write_online(config, the_plan, names)
    entry = record(config, online_results(RunFacts.resolve(config), names, the_plan), the_plan)
    out = Path(config.run_dir) / "hidden_states"
    assert json.loads((out / "online.json").read_text()) == settings and settings["layer_ids"] == [1, 2, 3]
    assert (entry["mode"], entry["in"], entry["ok"], entry["tokens"], entry["bytes"]) == (
        "online",
        7,
        7,
        sum(LENGTHS) + 42,
        0,
    )
    assert not list(out.glob("*.safetensors"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_extraction_matches_the_cpu_float32_forward(tiny, extractor):
    from eagle3.extract.hf import Placement

    gpu = HFExtractor(tiny, None, "bfloat16", Placement.for_replica(0, 1))
    assert gpu.device.startswith("cuda")
    batch = samples()
    for (a, b), (ref_a, ref_b) in zip(gpu.states(batch), extractor.states(batch)):
        scale = ref_a.abs().max().item()
        torch.testing.assert_close(a.float(), ref_a, rtol=3e-2, atol=3e-2 * max(scale, 1.0))
        torch.testing.assert_close(b.float(), ref_b, rtol=3e-2, atol=3e-2 * max(scale, 1.0))


def test_a_failing_write_gives_a_clear_error_and_leaves_no_shard(tmp_path, monkeypatch):
    import errno

    from eagle3.durable import DiskWriteError
    from eagle3.extract import store

    config, names = make_run(tmp_path)
    real, calls = store.os.pwrite, {"n": 0}

    def fails_later(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(store.os, "pwrite", fails_later)
    with pytest.raises(DiskWriteError, match=r"extract: writing .*shard-00000.safetensors failed: Input/output error"):
        run_stage(config, names)
    out = Path(config.run_dir) / "hidden_states"
    assert not (out / "shard-00000.done.json").exists() and not (out / "shard-00000.safetensors").exists()
    assert not list(out.glob(".*partial"))


def test_a_truncated_tokenized_shard_is_named_before_any_work(tmp_path):
    config, names = make_run(tmp_path)
    path = Path(config.run_dir) / "tokenized" / "shard-00001.parquet"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(
        ExtractInputError,
        match=r"shard-00001.parquet is missing or differs from what the tokenize stage wrote.*eagle3 tokenize",
    ):
        run_stage(config, names)


def test_cpu_threads_never_exceed_the_cores_the_process_may_use(monkeypatch):
    import os

    from eagle3.extract import hf

    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3}, raising=False)
    assert hf.cpu_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert hf.cpu_threads() == 8, "torch's own default (physical cores, OMP_NUM_THREADS) when it is lower"


def test_a_shard_whose_num_tokens_disagree_with_its_ids_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.durable import sha256_file

    config, names = make_run(tmp_path)
    path = Path(config.run_dir) / "tokenized" / "shard-00001.parquet"
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("num_tokens"), "num_tokens", pa.array([12, 31], pa.int32()))
    pq.write_table(table, path)
    marker = path.with_name("shard-00001.done.json")
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "parquet_sha256": sha256_file(path)}))
    with pytest.raises(ExtractInputError, match=r"row 's1-1' has 30 input ids but num_tokens=31"):
        run_stage(config, names)
