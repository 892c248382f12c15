"""fp8 hidden states (extract.storage_dtype = "fp8_e4m3"): the round trip within e4m3's error bound,
the file's layout, a lying file refused by name, and the stage storing and reading them."""

import json
import struct
import sys

import pytest
import torch

from conftest import ROOT
from eagle3.extract.errors import StatesError
from eagle3.extract.store import FP8_MAX, ShardStates, StatesWriter, states_bytes
from eagle3.run_facts import RunFacts

sys.path.insert(0, str(ROOT / "tests"))
from extract_runs import make_run  # noqa: E402

H = 16


def states(lengths, seed=0):
    """Per-token and per-layer magnitudes that differ by orders of magnitude, plus an all-zero row
    (a scale must not divide by zero) and a spike (an outlier the scale must not clip)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        size = torch.logspace(-3, 3, n)[:, None, None] * torch.tensor([1.0, 10.0, 0.1])[None, :, None]
        aux = (torch.randn(n, 3, H, generator=g) * size).reshape(n, 3 * H)
        last = torch.randn(n, H, generator=g) * 50
        aux[0] = 0.0
        last[-1, 3] = 1e4
        out.append((aux, last))
    return out


def write(path, data, storage):
    with StatesWriter(path, [len(a) for a, _ in data], H, {"model": "m"}, storage) as w:
        for k in reversed(range(len(data))):  # out of order, as length-sorted batches write
            w.write(k, *data[k])
        w.commit()


def within_e4m3(stored: torch.Tensor, exact: torch.Tensor, groups: int):
    """e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; values
    below its smallest normal (2^-6 of the scale's range) by at most half its subnormal step, 2^-10
    of the row's scale; the bf16 the reader returns adds 2^-8."""
    n = exact.shape[0]
    exact_bf16 = exact.to(torch.bfloat16).float()
    scale = exact_bf16.reshape(n, groups, -1).abs().amax(dim=2, keepdim=True) / FP8_MAX
    bound = (2**-4 + 2**-8) * exact_bf16.abs().reshape(n, groups, -1) + scale * 2**-9
    error = (stored.float() - exact_bf16).abs().reshape(n, groups, -1)
    assert (error <= bound * 1.001 + 1e-30).all(), float((error - bound).max())


def test_fp8_round_trip_is_within_the_formats_error_and_half_the_bytes(tmp_path):
    data = states([5, 1, 9])
    write(tmp_path / "fp8.safetensors", data, "fp8_e4m3")
    write(tmp_path / "bf16.safetensors", data, "bfloat16")
    fp8, bf16 = ShardStates(tmp_path / "fp8.safetensors"), ShardStates(tmp_path / "bf16.safetensors")
    assert fp8.storage == "fp8_e4m3" and bf16.storage == "bfloat16" and fp8.metadata["model"] == "m"
    for k, (aux, last) in enumerate(data):
        a, b = fp8.sample(k)
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == aux.shape and b.shape == last.shape
        within_e4m3(a, aux, 3)
        within_e4m3(b, last, 1)
        assert torch.equal(a[0], torch.zeros(3 * H, dtype=torch.bfloat16)) if k == 0 else True
        assert float(b[-1, 3]) == pytest.approx(1e4, rel=2**-4), "the outlier sets its row's scale, unclipped"
    tokens = 15
    data_bytes = {p: p.stat().st_size for p in (tmp_path / "fp8.safetensors", tmp_path / "bf16.safetensors")}
    fp8_size, bf16_size = data_bytes.values()
    header = 8 + 4096  # the JSON header is under 4 KiB here
    assert states_bytes(tokens, H, "fp8_e4m3") < fp8_size < states_bytes(tokens, H, "fp8_e4m3") + header
    assert states_bytes(tokens, H) < bf16_size < states_bytes(tokens, H) + header
    assert states_bytes(tokens, H, "fp8_e4m3") == tokens * (4 * H + 16)


def header_of(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), 8 + n


def test_a_bad_scale_is_refused_naming_the_file_and_row(tmp_path):
    path = tmp_path / "shard-00007.safetensors"
    write(path, states([4, 3]), "fp8_e4m3")
    header, base = header_of(path)
    start = base + header["scale"]["data_offsets"][0]
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        with open(path, "r+b") as f:
            f.seek(start + (5 * 4 + 2) * 4)  # row 5, layer 2
            f.write(struct.pack("<f", bad))
        with pytest.raises(StatesError, match=r"shard-00007.safetensors: 'scale' row 5 is not finite and positive"):
            ShardStates(path)


def test_a_file_whose_dtypes_disagree_with_its_storage_is_refused(tmp_path):
    from safetensors.torch import save_file

    offsets = torch.tensor([0, 2], dtype=torch.int64)
    meta = {"format": "eagle3-hidden-states/1", "storage": "fp8_e4m3"}
    bf16 = {"offsets": offsets, "aux": torch.zeros(2, 3 * H, dtype=torch.bfloat16), "last": torch.zeros(2, H)}
    save_file(bf16, str(tmp_path / "a.safetensors"), metadata=meta)
    with pytest.raises(StatesError, match=r"a.safetensors: tensor 'aux' is BF16 .* expected F8_E4M3"):
        ShardStates(tmp_path / "a.safetensors")
    fp8 = {k: v.to(torch.float8_e4m3fn) if k != "offsets" else v for k, v in bf16.items()}
    save_file(fp8, str(tmp_path / "b.safetensors"), metadata=meta)
    with pytest.raises(StatesError, match="b.safetensors: fp8 storage without its 'scale' tensor"):
        ShardStates(tmp_path / "b.safetensors")
    save_file({**fp8, "scale": torch.ones(2, 4, dtype=torch.float64)}, str(tmp_path / "c.safetensors"), metadata=meta)
    with pytest.raises(StatesError, match=r"c.safetensors: 'scale' is torch.float64 \[2, 4\], expected float32"):
        ShardStates(tmp_path / "c.safetensors")
    save_file(fp8, str(tmp_path / "d.safetensors"), metadata={**meta, "storage": "int4"})
    with pytest.raises(StatesError, match=r"d.safetensors: storage 'int4' is not one of"):
        ShardStates(tmp_path / "d.safetensors")


def test_the_stage_stores_fp8_reads_back_close_to_bf16_and_a_storage_change_re_extracts(tmp_path):
    from eagle3.extract.stage import extract_shard, plan
    from eagle3.manifest import read_manifest  # noqa: F401 -- the stage records into it

    config, names = make_run(tmp_path)
    bf16_plan = plan(RunFacts.resolve(config), names)
    for s in names:
        extract_shard(config, s, bf16_plan)
    states_dir = tmp_path / "run" / "hidden_states"
    reference = {s: ShardStates(states_dir / s.replace(".parquet", ".safetensors")) for s in names}
    reference = {s: [r.sample(k) for k in range(len(r))] for s, r in reference.items()}
    bf16_bytes = sum((states_dir / s.replace(".parquet", ".safetensors")).stat().st_size for s in names)

    fp8_config = config.model_copy(update={"extract": config.extract.model_copy(update={"storage_dtype": "fp8_e4m3"})})
    fp8_plan = plan(RunFacts.resolve(fp8_config), names)
    assert fp8_plan.storage == "fp8_e4m3" and not any(fp8_plan.done.values()), "a storage change re-extracts"
    assert fp8_plan.bytes_needed < 0.55 * bf16_plan.bytes_needed
    for s in names:
        result = extract_shard(fp8_config, s, fp8_plan)
        assert not result.skipped
        stored = ShardStates(states_dir / s.replace(".parquet", ".safetensors"))
        assert stored.storage == "fp8_e4m3"
        index = json.loads((states_dir / s.replace(".parquet", ".index.json")).read_text())
        assert index["dtype"] == "fp8_e4m3"
        for k, (aux, last) in enumerate(reference[s]):
            a, b = stored.sample(k)
            within_e4m3(a, aux, 3)
            within_e4m3(b, last, 1)
    fp8_bytes = sum((states_dir / s.replace(".parquet", ".safetensors")).stat().st_size for s in names)
    assert fp8_bytes < 0.55 * bf16_bytes
    assert all(plan(RunFacts.resolve(fp8_config), names).done.values()), "fp8 shards on disk are done for an fp8 config"
    assert not any(plan(RunFacts.resolve(config), names).done.values()), "and not for a bf16 one"
