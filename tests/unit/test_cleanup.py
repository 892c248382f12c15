"""Cleanup never deletes outside the run dir, whatever the config says and whatever symlinks
sit in the run dir: remove_inside (eagle3/durable.py) on its own, the stages' deletions with a
canary outside the run dir reachable through a planted symlink, and the run_dir validator."""

import json
import logging
import os
import types
from pathlib import Path

import pytest

from eagle3.config import DEMO_RECIPE, ConfigError, PipelineConfig, load_config
from eagle3.durable import UnsafeDeleteError, remove_inside


@pytest.fixture()
def layout(tmp_path):
    """tmp/run (the run dir) and tmp/outside/canary.txt (must survive every test)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "canary.txt").write_text("still here")
    (outside / "deep").mkdir()
    return run, outside


def canary_alive(outside: Path) -> bool:
    return (outside / "canary.txt").read_text() == "still here" and (outside / "deep").is_dir()


# -- remove_inside ------------------------------------------------------------------------------


def test_removes_files_and_trees_inside_the_root(layout):
    run, _ = layout
    (run / "stage" / "sub").mkdir(parents=True)
    (run / "stage" / "sub" / "f").write_text("x")
    (run / "marker.json").write_text("{}")
    assert remove_inside(run / "marker.json", run) is True
    assert remove_inside(run / "stage", run) is True
    assert sorted(os.listdir(run)) == []
    assert remove_inside(run / "gone", run) is False
    with pytest.raises(FileNotFoundError):
        remove_inside(run / "gone", run, missing_ok=False)


@pytest.mark.parametrize(
    "trick", ["../outside/canary.txt", "../outside", "stage/../../outside", "stage/..", ".", "", "/", "stage/."]
)
def test_refuses_paths_that_are_not_strictly_inside(layout, trick):
    run, outside = layout
    (run / "stage").mkdir()
    target = f"{run}/{trick}"  # a string: pathlib would drop the "." of "stage/."
    with pytest.raises(UnsafeDeleteError, match="refusing to delete"):
        remove_inside(target, run)
    assert canary_alive(outside) and (run / "stage").is_dir() and run.is_dir()


def test_refusal_names_both_paths_and_is_not_silenced_by_ignore_errors(layout):
    run, outside = layout
    with pytest.raises(UnsafeDeleteError) as err:
        remove_inside(outside / "canary.txt", run, ignore_errors=True)
    assert str(outside / "canary.txt") in str(err.value) and str(run) in str(err.value)
    assert canary_alive(outside)


def test_the_root_itself_is_refused(layout):
    run, _ = layout
    with pytest.raises(UnsafeDeleteError, match="not strictly inside"):
        remove_inside(run, run)
    with pytest.raises(UnsafeDeleteError):
        remove_inside(str(run) + "/", run)
    assert run.is_dir()


def test_a_symlink_pointing_out_is_unlinked_never_followed(layout):
    run, outside = layout
    (run / "to-dir").symlink_to(outside, target_is_directory=True)
    (run / "to-file").symlink_to(outside / "canary.txt")
    assert remove_inside(run / "to-dir", run) is True
    assert remove_inside(run / "to-file", run) is True
    assert not os.path.lexists(run / "to-dir") and not os.path.lexists(run / "to-file")
    assert canary_alive(outside)


def test_a_tree_holding_a_symlink_out_is_removed_without_recursing_into_it(layout):
    run, outside = layout
    (run / "work" / "inner").mkdir(parents=True)
    (run / "work" / "inner" / "escape").symlink_to(outside, target_is_directory=True)
    (run / "work" / "file-link").symlink_to(outside / "canary.txt")
    assert remove_inside(run / "work", run) is True
    assert not (run / "work").exists()
    assert canary_alive(outside)


def test_paths_through_a_symlinked_folder_are_judged_where_they_really_are(layout):
    run, outside = layout
    (run / "escape").symlink_to(outside / "deep", target_is_directory=True)
    with pytest.raises(UnsafeDeleteError):
        remove_inside(run / "escape" / "x", run)  # resolves to outside/deep/x
    # The kernel resolves "escape/.." to outside/, not to run/: so does remove_inside.
    with pytest.raises(UnsafeDeleteError):
        remove_inside(run / "escape" / ".." / "canary.txt", run)
    assert canary_alive(outside)


def test_a_symlinked_run_dir_is_fine(layout, tmp_path):
    _, outside = layout
    real = tmp_path / "bigdisk" / "run"
    (real / "prompts").mkdir(parents=True)
    (real / "prompts" / "x").write_text("x")
    link = tmp_path / "run-link"
    link.symlink_to(real, target_is_directory=True)
    assert remove_inside(link / "prompts" / "x", link) is True
    assert canary_alive(outside)


@pytest.mark.parametrize("root", ["/", "~"])
def test_a_filesystem_root_or_home_is_never_a_root(root):
    with pytest.raises(UnsafeDeleteError, match="not a safe run directory"):
        remove_inside(Path(os.path.expanduser(root)) / "definitely-not-here-eagle3", os.path.expanduser(root))


# -- the stages' deletions, with a planted symlink ------------------------------------------------


def test_extract_vllm_work_dir_symlinked_out_survives_the_stage_cleanup(layout, monkeypatch):
    """RUN/hidden_states/.vllm-shard-00000 is removed after extraction (even a failed one); planted
    as a symlink to an outside folder, only the link goes."""
    import eagle3.extract.vllm_backend as backend
    from eagle3.extract import stage

    run, outside = layout
    (run / "hidden_states").mkdir()
    work = run / "hidden_states" / ".vllm-shard-00000"
    work.symlink_to(outside, target_is_directory=True)
    seen = []

    def failing_extract(python, model, layers, samples, chunks, work_dir, *args, **kwargs):
        seen.append(Path(work_dir))
        raise RuntimeError("worker died")
        yield  # a generator, as stream_with_vllm is

    monkeypatch.setattr(backend, "stream_with_vllm", failing_extract)
    config = load_config(DEMO_RECIPE, [f'run_dir="{run}"'])
    plan = types.SimpleNamespace(layer_ids=[1, 2, 3], num_layers=4, model_path="unused")
    with pytest.raises(RuntimeError, match="worker died"):
        stage._fill_with_vllm(config, "shard-00000.parquet", ["a"], [[1, 2, 3]], plan, None, logging.getLogger("test"))
    assert seen == [work]
    assert not os.path.lexists(work)
    assert canary_alive(outside)


def _trainer_stub(run: Path, step: int):
    """Just what Trainer.save touches, so the real save runs without a model or torchrun."""
    import torch

    from eagle3.train.trainer import Trainer

    stub = types.SimpleNamespace(
        run=run,
        ckpt_dir=run / "checkpoints",
        step=step,
        best=None,
        total_steps=20,
        layer_ids=[1, 2, 3],
        model_path="m",
        tc=types.SimpleNamespace(seed=0, strategy="ddp", grad_accum=1, batch_tokens=120),
        dist=types.SimpleNamespace(rank=0, world=1, barrier=lambda: None),
        drafter_config=types.SimpleNamespace(to_json=lambda: "{}"),
        _full_state=lambda: ({"w": torch.zeros(2)}, {"state": {}}),
    )
    stub._write_checkpoint = types.MethodType(Trainer._write_checkpoint, stub)
    return stub, Trainer


@pytest.mark.parametrize("planted", ["partial", "step-000010"])
def test_checkpoint_partial_or_final_symlinked_out_survives_a_save(layout, planted):
    """Before a save, the step's partial folder and an existing final one are removed; planted as
    symlinks to an outside folder, the links go and the checkpoint is written as a real folder."""
    run, outside = layout
    stub, Trainer = _trainer_stub(run, 10)
    from eagle3.durable import owned_prefix

    stub.ckpt_dir.mkdir()
    final = stub.ckpt_dir / "step-000010"
    partial = stub.ckpt_dir / f"{owned_prefix(final)}partial"  # this process's temporary name for the step
    (partial if planted == "partial" else final).symlink_to(outside, target_is_directory=True)
    Trainer.save(stub)
    assert final.is_dir() and not final.is_symlink() and (final / "model.safetensors").exists()
    assert not os.path.lexists(partial)
    assert json.loads((stub.ckpt_dir / "latest.json").read_text())["step"] == 10
    assert canary_alive(outside) and sorted(os.listdir(outside)) == ["canary.txt", "deep"]


def test_export_folder_symlinked_out_is_replaced_without_touching_its_target(layout):
    """Re-exporting moves the old layout folder aside and removes it; an export folder that is a
    symlink to an outside folder loses the link only."""
    import torch

    from eagle3.export.layouts import write_layout

    run, outside = layout
    (run / "export").mkdir()
    out = run / "export" / "vllm"
    out.symlink_to(outside, target_is_directory=True)
    write_layout(out, {"architectures": ["x"]}, {"w": torch.zeros(2)}, {"layout": "vllm"})
    assert out.is_dir() and not out.is_symlink() and (out / "config.json").exists()
    assert sorted(os.listdir(run / "export")) == ["vllm"]  # no temporary or moved-aside entry left
    assert canary_alive(outside) and sorted(os.listdir(outside)) == ["canary.txt", "deep"]


def test_prepare_never_removes_stale_shards_through_a_symlinked_prompts_folder(layout):
    """prepare removes shard files left from a run with more shards; when RUN/prompts is a symlink
    out of the run dir, those files are not the run's, and prepare stops instead."""
    from eagle3.prepare.stage import run_prepare

    run, outside = layout
    (outside / "shard-00007.parquet").write_text("someone else's file")
    (run / "prompts").symlink_to(outside, target_is_directory=True)
    src = run / "p.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(4)))
    with pytest.raises(UnsafeDeleteError, match="not strictly inside"):
        run_prepare(load_config(DEMO_RECIPE, [f'run_dir="{run}"', f'data.source="{src}"', "data.num_shards=1"]))
    assert (outside / "shard-00007.parquet").read_text() == "someone else's file"
    assert canary_alive(outside)


def test_prepare_removes_stale_shards_inside_the_run_dir(layout):
    from eagle3.prepare.stage import run_prepare

    run, _ = layout
    (run / "prompts").mkdir()
    (run / "prompts" / "shard-00007.parquet").write_text("stale")
    src = run / "p.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(4)))
    run_prepare(load_config(DEMO_RECIPE, [f'run_dir="{run}"', f'data.source="{src}"', "data.num_shards=1"]))
    assert not (run / "prompts" / "shard-00007.parquet").exists()


# -- run_dir validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_dir",
    [
        "/",
        "~",
        "",
        "/usr",
        "/tmp",
        "/.",
        "//",
        "/usr/..",
        os.path.expanduser("~"),
        os.path.dirname(os.path.expanduser("~")),
    ],
)
def test_config_refuses_unsafe_run_dirs(run_dir):
    with pytest.raises(ConfigError, match="not a safe run directory"):
        load_config(DEMO_RECIPE, [f"run_dir={json.dumps(run_dir)}"])


def test_config_accepts_ordinary_run_dirs(tmp_path):
    for run_dir in ("runs/demo", str(tmp_path / "run"), "~/runs/x", "/tmp/eagle3-run"):
        assert PipelineConfig(run_dir=run_dir).run_dir == run_dir


def test_a_symlink_at_the_hidden_states_temporary_name_is_not_written_through(layout):
    """StatesWriter truncates its temporary file: a link planted at that name (pointing at a file
    outside the run dir) is replaced by a file of its own, and the outside file keeps its bytes."""
    import torch
    from safetensors import safe_open

    from eagle3.extract.store import StatesWriter

    run, outside = layout
    path = run / "hidden_states" / "shard-00000.safetensors"
    path.parent.mkdir()
    (path.parent / f".{path.name}.partial").symlink_to(outside / "canary.txt")
    with StatesWriter(path, [3], hidden=4) as writer:
        writer.write(0, torch.ones(3, 12), torch.ones(3, 4))
        writer.commit()
    assert canary_alive(outside)
    with safe_open(str(path), framework="pt") as stored:
        assert stored.get_tensor("last").shape == (3, 4)


def test_a_symlinked_generation_file_is_refused_not_appended_through(layout):
    from eagle3.records import JsonlAppender, RecordFileError

    run, outside = layout
    shard = run / "generations" / "shard-00000.jsonl"
    shard.parent.mkdir()
    shard.symlink_to(outside / "canary.txt")
    with pytest.raises(RecordFileError, match=r"shard-00000.jsonl: is a symbolic link"):
        JsonlAppender(shard)
    assert canary_alive(outside)
