"""Temporaries of whole-file writes: a writer SIGKILLed between creating its temporary and the
rename leaves it behind; the next writer removes it, and only temporaries whose owner is gone."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from eagle3.durable import _HOST, atomic_write_bytes, orphaned_temporaries, owned_prefix, sweep_orphaned_temporaries

KILLED_INSIDE = """
import sys, time
from eagle3.durable import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half of a file")
    print(tmp, flush=True)
    time.sleep(600)
"""


def killed_writer(target: Path) -> Path:
    """Run a writer that stops inside atomic_path, SIGKILL it there, return the temporary it left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_INSIDE, str(target)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        tmp = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert tmp.exists() and tmp.name.startswith(f".{target.name}.{proc.pid}@"), tmp
    return tmp


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


def test_a_write_killed_inside_leaves_a_temporary_the_next_write_removes(tmp_path):
    target = tmp_path / "vocab" / "draft_vocab.safetensors"
    left = killed_writer(target)
    assert not target.exists()
    assert orphaned_temporaries(target) == [left]
    atomic_write_bytes(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert sorted(os.listdir(target.parent)) == [target.name]  # the killed writer's temporary is gone, no new one left


def test_only_temporaries_whose_owner_is_gone_are_removed(tmp_path):
    target = tmp_path / "manifest.json"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        keep = [
            tmp_path / f".manifest.json.{live.pid}@{_HOST}.abc.tmp",  # a writer still at work
            tmp_path
            / f".manifest.json.{dead_pid()}@another-host.abc.tmp",  # a shared run dir: not this host's to judge
            tmp_path / ".manifest.json.k2j4.tmp",  # no owner in the name
            tmp_path / f".other.json.{dead_pid()}@{_HOST}.abc.tmp",  # another target's
        ]
        gone = tmp_path / f".manifest.json.{dead_pid()}@{_HOST}.abc.tmp"
        for path in [*keep, gone]:
            path.write_text("x")
        atomic_write_bytes(target, b"{}")
        assert not gone.exists()
        assert all(p.exists() for p in keep), [p.name for p in keep if not p.exists()]
    finally:
        live.kill()
        live.wait(30)


def test_sweep_removes_every_orphan_in_a_folder_and_unlinks_planted_links(tmp_path):
    """Checkpoint partials carry the step in their name; a sweep of the folder removes those of any
    step. An orphan name that is a symlink to a folder elsewhere loses the link, never the folder."""
    ckpt, outside = tmp_path / "run" / "checkpoints", tmp_path / "outside"
    ckpt.mkdir(parents=True)
    outside.mkdir()
    (outside / "canary.txt").write_text("alive")
    pid = dead_pid()
    partial = ckpt / f".step-000004.{pid}@{_HOST}.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    link = ckpt / f".step-000008.{pid}@{_HOST}.partial"
    link.symlink_to(outside, target_is_directory=True)
    (ckpt / "step-000002").mkdir()
    removed = sweep_orphaned_temporaries(ckpt)
    assert sorted(p.name for p in removed) == sorted([partial.name, link.name])
    assert sorted(os.listdir(ckpt)) == ["step-000002"]
    assert (outside / "canary.txt").read_text() == "alive"


def test_owned_names_parse_whatever_the_target_name_holds(tmp_path):
    """Dots, '@' and digits in the target's own name do not confuse the owner."""
    for name in ("a.b.c", "x@y.json", "step-000010", "12345"):
        target = tmp_path / name
        tmp = tmp_path / f"{owned_prefix(target)}q1w2.tmp"
        tmp.write_text("x")
        assert orphaned_temporaries(target) == []  # its owner (this process) is alive
        orphan = tmp_path / f".{name}.{dead_pid()}@{_HOST}.q1w2.tmp"
        orphan.write_text("x")
        assert orphaned_temporaries(target) == [orphan], name
        orphan.unlink()
        tmp.unlink()


def test_an_export_killed_midway_leaves_nothing_after_the_next_export(tmp_path):
    import torch

    from eagle3.export.layouts import write_layout

    out = tmp_path / "export" / "vllm"
    out.parent.mkdir()
    pid = dead_pid()
    half = out.parent / f".vllm.{pid}@{_HOST}.x7.tmp"  # a layout folder half written
    half.mkdir()
    (half / "config.json").write_text("{")
    aside = out.parent / f".vllm.{pid}@{_HOST}.123456.old"  # an older layout set aside, not yet removed
    aside.mkdir()
    write_layout(out, {"architectures": ["x"]}, {"w": torch.zeros(2)}, {"layout": "vllm"})
    assert sorted(os.listdir(out.parent)) == ["vllm"]


def test_atomic_folder_replaces_the_target_whole_or_leaves_it_as_it_was(tmp_path):
    from eagle3.durable import atomic_folder

    target = tmp_path / "checkpoints" / "step-000004"
    with atomic_folder(target) as tmp:
        assert tmp.parent == target.parent and tmp.name == f"{owned_prefix(target)}partial" and not target.exists()
        (tmp / "a.bin").write_bytes(b"first")
    assert sorted(os.listdir(target.parent)) == ["step-000004"] and (target / "a.bin").read_bytes() == b"first"

    try:
        with atomic_folder(target) as tmp:
            (tmp / "a.bin").write_bytes(b"half")
            raise OSError(28, "No space left on device")
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("the error must reach the caller")
    assert sorted(os.listdir(target.parent)) == ["step-000004"], "no partial folder left"
    assert (target / "a.bin").read_bytes() == b"first", "the old folder is untouched"

    with atomic_folder(target) as tmp:
        (tmp / "b.bin").write_bytes(b"second")
    assert sorted(os.listdir(target)) == ["b.bin"], "replaced whole, nothing of the old folder kept"
    assert sorted(os.listdir(target.parent)) == ["step-000004"], "the old folder set aside is removed"


def test_atomic_folder_unlinks_planted_links_and_never_follows_them(tmp_path):
    from eagle3.durable import atomic_folder

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary.txt").write_text("alive")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    target = folder / "step-000002"
    (folder / f"{owned_prefix(target)}partial").symlink_to(outside, target_is_directory=True)
    target.symlink_to(tmp_path / "nowhere", target_is_directory=True)  # a dangling link where the folder goes
    with atomic_folder(target) as tmp:
        assert not tmp.is_symlink() and tmp.is_dir()
        (tmp / "w.bin").write_bytes(b"w")
    assert target.is_dir() and not target.is_symlink() and (target / "w.bin").read_bytes() == b"w"
    assert sorted(os.listdir(folder)) == ["step-000002"]
    assert sorted(os.listdir(outside)) == ["canary.txt"] and (outside / "canary.txt").read_text() == "alive"
