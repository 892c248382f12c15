"""Faults between and under the stages: a disk that fails during generation appends and checkpoint
saves, and bad input between stages (wrong Parquet schema, a tokenizer changed since tokenize,
layer ids changed since extract). Each must end in one clear error naming the file and what
differs, leave nothing that looks complete, and let the rerun finish once the fault is gone."""

import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3 import records as records_module
from eagle3.durable import DiskWriteError, sha256_file
from eagle3.generate.shard import paths
from eagle3.run_facts import RunFacts
from eagle3.schemas import SchemaError, TokenizerMismatchError, tokenizer_hash
from fake_openai import FakeConfig, run_fake_server
from test_generate_faults import generate, make_run as make_generation_run, records

# -- a disk that fails under generation --------------------------------------------------------


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def disk_fills_after(monkeypatch, name: str, whole: int):
    """os.write fails with ENOSPC on ``name`` after ``whole`` records: the next record gets half its
    bytes written (a short write, as a filling disk gives), then every write fails."""
    real, seen = os.write, {"records": 0, "full": False}

    def write(fd, data):
        if not fd_path(fd).endswith(name):
            return real(fd, data)
        if seen["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        if seen["records"] == whole:
            seen["full"] = True
            return real(fd, bytes(data[: len(data) // 2]))
        seen["records"] += 1
        return real(fd, data)

    monkeypatch.setattr(records_module.os, "write", write)


def fsync_fails_after(monkeypatch, name: str, good: int):
    real, seen = os.fsync, {"n": 0}

    def fsync(fd):
        if fd_path(fd).endswith(name):
            seen["n"] += 1
            if seen["n"] > good:
                raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(records_module.os, "fsync", fsync)


PROMPTS = [f"prompt number {k} about {'x ' * (k % 7)}" for k in range(40)]


@pytest.mark.parametrize("fault", ["full_disk_mid_record", "fsync_error"])
def test_a_failing_write_during_generation_leaves_no_marker_and_no_torn_record(tmp_path, monkeypatch, fault):
    sets = ("generation.fsync_every=4", "generation.fsync_min_interval_s=0", "generation.max_tokens=64")
    config, shard = make_generation_run(tmp_path, PROMPTS, *sets)
    out = Path(config.run_dir) / "generations"
    p = paths(out, shard.name)
    with run_fake_server(FakeConfig(), in_thread=True) as fake:
        if fault == "full_disk_mid_record":
            disk_fills_after(monkeypatch, "shard-00000.jsonl", whole=11)
            expected = (
                r"generate: writing .*generations/shard-00000.jsonl failed: No space left on device; .* GiB free there"
            )
        else:
            fsync_fails_after(monkeypatch, "shard-00000.jsonl", good=2)
            expected = (
                r"generate: writing .*generations/shard-00000.jsonl failed: Input/output error; .* GiB free there"
            )
        with pytest.raises(DiskWriteError, match=expected):
            generate(config, shard, [fake.base_url])
        monkeypatch.undo()
        assert not p["done"].exists(), "no completion marker after a failed write"
        raw = p["ok"].read_bytes()
        assert raw.endswith(b"\n"), "the partial record was cut off: the file ends on a whole record"
        kept = [json.loads(line) for line in raw.splitlines()]
        if fault == "full_disk_mid_record":
            assert len(kept) == 11, "the records before the fault are kept, the torn one is not"
        # A full disk stops the shard at the failing write. An fsync runs behind (eagle3/records.py): the records
        # that arrived while it ran are written before its failure is seen, possibly all of them.
        assert len(kept) < len(PROMPTS) if fault == "full_disk_mid_record" else len(kept) <= len(PROMPTS)
        assert len({r["id"] for r in kept}) == len(kept)

        result = generate(config, shard, [fake.base_url])
    assert (result.in_, result.ok, result.failed, result.filtered, result.skipped) == (
        len(PROMPTS),
        len(PROMPTS),
        0,
        0,
        False,
    )
    ids = [r["id"] for r in records(config)]
    wanted = set(pq.read_table(shard, columns=["id"]).column("id").to_pylist())
    assert len(ids) == len(wanted) and set(ids) == wanted, "every prompt exactly once after the rerun"
    assert json.loads(p["done"].read_text())["counts"]["ok"] == len(PROMPTS)


# -- a disk that fails under a checkpoint save -------------------------------------------------


# What the native serialisers raise when the disk fills mid-file (measured on a full 1 MiB tmpfs).
NATIVE_FULL_DISK = {
    "safetensors": (
        "Error while serializing: I/O error: No space left on device (os error 28)",
        r"No space left on device \(Error while serializing: I/O error: .*\(os error 28\)\)",
    ),
    "torch": (
        "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534",
        r"Input/output error \(\[enforce fail .* unexpected pos 576 vs 534\)",
    ),
}


@pytest.mark.parametrize("writer", sorted(NATIVE_FULL_DISK))
def test_a_failing_checkpoint_save_keeps_latest_on_the_previous_checkpoint(tmp_path, monkeypatch, writer):
    import safetensors.torch
    from safetensors import SafetensorError

    from eagle3.models import resolve_model
    from eagle3.train import trainer as trainer_module
    from eagle3.train.trainer import Dist, Trainer
    from test_train import lines, make_train_run

    config, names = make_train_run(tmp_path, "train.epochs=1")
    ckpt = Path(config.run_dir) / "checkpoints"
    raised, expected = NATIVE_FULL_DISK[writer]
    module, name = (safetensors.torch, "save_file") if writer == "safetensors" else (trainer_module.torch, "save")
    real, calls = getattr(module, name), {"n": 0}

    def fails_on_second_checkpoint(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] < 2:
            return real(obj, f, *a, **k)
        Path(f).write_bytes(b"half a file")
        raise (SafetensorError if writer == "safetensors" else RuntimeError)(raised)

    monkeypatch.setattr(module, name, fails_on_second_checkpoint)
    trainer = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=lambda m: None)
    total = trainer.total_steps
    assert total >= 6, "enough steps for a checkpoint after the failed one"
    with pytest.raises(
        DiskWriteError,
        match=rf"train: checkpoint: writing .*checkpoints/step-000004 failed: {expected}; .* GiB free there",
    ):
        trainer.train()
    monkeypatch.undo()
    assert sorted(x.name for x in ckpt.iterdir()) == ["latest.json", "step-000002"], (
        "no step-000004 folder, finished or partial"
    )
    assert json.loads((ckpt / "latest.json").read_text())["path"] == str((ckpt / "step-000002").resolve())

    said = []
    result = Trainer(config, names, resolve_model("tiny:qwen3"), [1, 2, 3], Dist(), log=said.append).train()
    assert any(m.startswith(f"resumed from {ckpt.resolve() / 'step-000002'} (step 2 of {total})") for m in said), said
    assert result["steps"] == total
    assert [x["step"] for x in lines(Path(config.run_dir) / "train" / "log.jsonl")] == list(range(1, total + 1)), (
        "no step lost, none twice"
    )
    assert json.loads((ckpt / "latest.json").read_text())["step"] == total


def test_a_disk_error_inside_torchrun_comes_back_as_one_disk_error(tmp_path):
    from eagle3.train.stage import _run_streamed

    message = (
        "train: checkpoint: writing /r/checkpoints/step-000004 failed: No space left on device; 0.00 GiB free there. "
        "Nothing was marked complete"
    )
    script = (
        "import sys\nprint('Traceback (most recent call last):')\nprint('  File \"trainer.py\", line 1')\n"
        f"print('[rank0]: eagle3.durable.DiskWriteError: {message}', flush=True)\n"
        "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ...')\nsys.exit(1)\n"
    )
    with pytest.raises(DiskWriteError) as caught:
        _run_streamed([sys.executable, "-c", script], 60, __import__("logging").getLogger("t"), cwd=tmp_path, threads=1)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "error",
    [
        DiskWriteError(
            errno.ENOSPC, "generate: writing /r/generations/shard-00000.jsonl failed: No space left on device"
        ),
        SchemaError(
            "/r/tokenized/shard-00000.parquet: column 'loss_mask' is list<item: float>, expected list<uint8|bool>"
        ),
        TokenizerMismatchError("/r/tokenized/shard-00000.done.json: tokenizer hash 1 vs 2"),
    ],
)
def test_the_cli_prints_these_errors_as_one_line(monkeypatch, capsys, error):
    from cli import main as cli

    def fails(args):
        raise error

    monkeypatch.setattr(cli, "cmd_stage", fails)
    assert cli.main(["train"]) == 1
    err = capsys.readouterr().err
    assert err == f"eagle3 train: error: {error.strerror if isinstance(error, OSError) else error}\n"


# -- wrong schema between stages ---------------------------------------------------------------


def rewrite_tokenized(path: Path, **columns) -> None:
    """Replace columns of a tokenized shard and update its marker's hash, as a producer with
    another schema would have left it (so only the schema check can catch it)."""
    table = pq.read_table(path)
    for name, value in columns.items():
        index = table.schema.get_field_index(name)
        table = table.remove_column(index) if value is None else table.set_column(index, name, value)
    pq.write_table(table, path)
    marker = path.with_name(path.name.replace(".parquet", ".done.json"))
    done = json.loads(marker.read_text())
    marker.write_text(json.dumps({**done, "parquet_sha256": sha256_file(path)}))


def test_a_prompt_shard_with_the_wrong_columns_is_refused_before_any_request(tmp_path):
    config, shard = make_generation_run(tmp_path, ["one", "two"])
    table = pq.read_table(shard)
    as_text = pa.array([json.dumps(m) for m in table.column("messages").to_pylist()], pa.string())
    pq.write_table(table.set_column(table.schema.get_field_index("messages"), "messages", as_text), shard)
    with pytest.raises(
        SchemaError,
        match=r"prompts/shard-00000.parquet: column 'messages' is string, expected "
        r"list<struct<role: string, content: string>> \(the prompt shard \(RUN/prompts\) schema",
    ):
        generate(config, shard, ["http://127.0.0.1:9/v1"])  # nothing listens there: any request would fail differently
    pq.write_table(table.drop_columns(["messages"]), shard)
    with pytest.raises(
        SchemaError,
        match=(
            r"column 'messages' is missing; .* needs it as list<struct<role: string, content: string>> \(found "
            r"columns: id, source_index"
        ),
    ):
        generate(config, shard, ["http://127.0.0.1:9/v1"])
    p = paths(Path(config.run_dir) / "generations", shard.name)
    assert not p["meta"].exists() and not p["ok"].exists() and not p["failed"].exists(), (
        "nothing written for a refused shard"
    )


def test_a_prompt_shard_with_the_wrong_columns_is_refused_by_tokenize(tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path
    from test_kills import make_inputs

    run = tmp_path / "run"
    make_inputs(run, n=20)
    config = load_config(DEMO_RECIPE, [f'run_dir="{run}"', "data.num_shards=2"])
    shard = run / "prompts" / "shard-00000.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.drop_columns(["messages"]), shard)
    path = tokenizer_path(config)
    with pytest.raises(SchemaError, match=r"prompts/shard-00000.parquet: column 'messages' is missing"):
        tokenize_shard(RunFacts.resolve(config), shard.name, load_tokenizer(path))
    assert not (run / "tokenized" / "shard-00000.parquet").exists()


def test_a_tokenized_shard_with_string_ids_is_refused_by_extract_before_any_work(tmp_path):
    from eagle3.extract.stage import plan
    from extract_runs import make_run

    config, names = make_run(tmp_path)
    path = Path(config.run_dir) / "tokenized" / "shard-00001.parquet"
    ids = pq.read_table(path).column("input_ids").to_pylist()
    rewrite_tokenized(path, input_ids=pa.array([[str(t) for t in seq] for seq in ids], pa.list_(pa.string())))
    with pytest.raises(
        SchemaError,
        match=r"tokenized/shard-00001.parquet: column 'input_ids' is list<\w+: string>, expected list<int32>",
    ):
        plan(RunFacts.resolve(config), names)
    assert not (Path(config.run_dir) / "hidden_states").exists(), "no work before the check"


def stored_extract(config, names, layer_ids=(1, 2, 3)) -> None:
    """What run_train needs on disk besides the tokenized shards: a draft vocabulary and the extract
    stage's manifest entry (the states themselves are not read before the checks)."""
    import numpy as np
    from safetensors.numpy import save_file

    from eagle3.manifest import record_stage
    from eagle3.results import StageCounts

    vocab = Path(config.run_dir) / "vocab"
    vocab.mkdir(exist_ok=True)
    save_file(
        {"d2t": np.zeros(8, dtype=np.int64), "t2d": np.ones(4096, dtype=bool)}, str(vocab / "draft_vocab.safetensors")
    )
    record_stage(config.run_dir, "extract", StageCounts(7, 7), mode=config.extract.mode, layer_ids=list(layer_ids))


@pytest.mark.parametrize(
    "column, value, found",
    ids=["float", "missing"],
    argvalues=[
        (
            "loss_mask",
            lambda seqs: pa.array([[1.0] * len(s) for s in seqs], pa.list_(pa.float32())),
            "list<element: float>, expected list<uint8|bool>",
        ),
        ("loss_mask", lambda seqs: None, "missing; a tokenized shard needs it as list<uint8|bool>"),
    ],
)
def test_a_tokenized_shard_with_a_wrong_loss_mask_is_refused_by_train_before_torchrun(tmp_path, column, value, found):
    from eagle3.train.stage import run_train
    from extract_runs import make_run

    config, names = make_run(tmp_path)
    stored_extract(config, names)
    path = Path(config.run_dir) / "tokenized" / "shard-00000.parquet"
    rewrite_tokenized(path, **{column: value(pq.read_table(path).column("input_ids").to_pylist())})
    with pytest.raises(SchemaError, match=rf"tokenized/shard-00000.parquet: column '{column}' is {re.escape(found)}"):
        run_train(RunFacts.resolve(config), names)
    assert not (Path(config.run_dir) / "train" / "request.json").exists(), "torchrun never started"


def test_layer_ids_changed_after_extraction_are_refused_by_train(tmp_path):
    from eagle3.train.stage import TrainInputError, run_train
    from extract_runs import make_run

    config, names = make_run(tmp_path, ((7, 40),), "extract.layer_ids=[1, 2, 4]")
    stored_extract(config, names, layer_ids=(1, 2, 3))
    with pytest.raises(
        TrainInputError,
        match=(
            r"extract.layer_ids \[1, 2, 4\] differ from the \[1, 2, 3\] the extract stage used: run `eagle3 "
            r"extract` again"
        ),
    ):
        run_train(RunFacts.resolve(config), names)
    assert not (Path(config.run_dir) / "train" / "request.json").exists()


# -- the tokenizer changed between tokenize and the later stages -------------------------------


def test_a_tokenizer_changed_since_tokenize_is_refused_by_extract_and_train(tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config
    from eagle3.extract.stage import plan
    from eagle3.models import resolve_model
    from eagle3.tokenize.stage import tokenize_shard
    from eagle3.tokenizer import load_tokenizer, tokenizer_path
    from eagle3.train.stage import run_train
    from test_kills import make_inputs

    run = tmp_path / "run"
    make_inputs(run, n=24)
    model = tmp_path / "model"
    shutil.copytree(resolve_model("tiny:qwen3"), model)  # a copy: the shared cache stays as it is
    config = load_config(
        DEMO_RECIPE,
        [f'run_dir="{run}"', f'server.model="{model}"', "data.num_shards=2", 'extract.dtype="float32"'],
    )
    names = ["shard-00000.parquet", "shard-00001.parquet"]
    tok = load_tokenizer(tokenizer_path(config))
    for name in names:
        tokenize_shard(RunFacts.resolve(config), name, tok)
    marker = json.loads((run / "tokenized" / "shard-00000.done.json").read_text())
    assert marker["tokenizer"] == str(model) and len(marker["tokenizer_sha256"]) == 16
    plan(RunFacts.resolve(config), names)  # same tokenizer: no complaint

    moved = load_config(DEMO_RECIPE, [f'run_dir="{run}"', 'server.model="tiny:qwen3"', "data.num_shards=2"])
    plan(RunFacts.resolve(moved), names)  # the same tokenizer files in another folder: still the same tokenizer

    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    if a not in vocab or b not in vocab:
        a, b = sorted(vocab)[300], sorted(vocab)[301]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: every stored id of them now means the other
    (model / "tokenizer.json").write_text(json.dumps(spec))
    now = tokenizer_hash(str(model))
    assert now != marker["tokenizer_sha256"]

    def expected(stage: str) -> str:
        return re.escape(
            f"tokenized/shard-00000.done.json: the shard was tokenized with tokenizer {model} (hash "
            f"{marker['tokenizer_sha256']}), but {stage} would read its ids under {model} (hash {now}): the "
            "tokenizer changed between stages. Run `eagle3 tokenize` again"
        )

    with pytest.raises(TokenizerMismatchError, match=expected("extract")):
        plan(RunFacts.resolve(config), names)
    stored_extract(config, names)
    with pytest.raises(TokenizerMismatchError, match=expected("train")):
        run_train(RunFacts.resolve(config), names)
    assert not (run / "hidden_states").exists() and not (run / "train" / "request.json").exists(), (
        "refused before any work"
    )
