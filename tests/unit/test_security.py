"""Security promises that hold across stages: no pickle is ever loaded from a run directory, and
the defaults never expose a server beyond loopback. (The API key's absence from logs, artifacts
and reports is tested in test_managed_server.py and the pipeline flow test; the real server's
bind address in tests/integration/test_vllm_server.py.)"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import ROOT

PRODUCT = [ROOT / "eagle3", ROOT / "flows", ROOT / "tasks"]


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return ast.unparse(kw.value)
    return None


UNPICKLERS = (
    "pickle.load",
    "pickle.loads",
    "dill.load",
    "dill.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "joblib.load",
    "shelve.open",
    "marshal.load",
    "marshal.loads",
    "Unpickler",
    "read_pickle",
    "torch.jit.load",
)


def pickle_loaders(path: Path) -> list[str]:
    """Every call in the file that can unpickle: the pickle family's loaders, torch.load without
    weights_only=True, numpy loads with allow_pickle. (Importing pickle to catch its error is fine.)"""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in {
            "pickle",
            "dill",
            "cloudpickle",
            "joblib",
            "marshal",
            "shelve",
        }:
            found += [
                f"{path}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name != "UnpicklingError"
            ]
    for call, func in _calls(tree):
        where = f"{path}:{call.lineno}: {func}"
        if func.endswith("torch.load"):
            if _keyword(call, "weights_only") != "True":
                found.append(f"{where} without weights_only=True")
        elif func.endswith(("np.load", "numpy.load")) and _keyword(call, "allow_pickle") not in (None, "False"):
            found.append(f"{where} with allow_pickle")
        elif func.endswith(UNPICKLERS):
            found.append(where)
    return found


def test_the_scan_finds_the_loaders_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nimport torch, numpy as np\ntorch.load('x')\ntorch.load('y', weights_only=False)\n"
        "np.load('z', allow_pickle=True)\ntorch.load('ok', weights_only=True)\nnp.load('ok')\npickle.loads(b'')\n"
        "from pickle import Unpickler, UnpicklingError\n"
    )
    found = sorted(pickle_loaders(bad), key=lambda f: int(f.split(":")[1]))
    assert [int(f.split(":")[1]) for f in found] == [3, 4, 5, 8, 9], found


def test_no_product_code_can_unpickle():
    files = [p for d in PRODUCT for p in d.rglob("*.py")]
    assert len(files) > 40
    found = [f for p in files for f in pickle_loaders(p)]
    assert found == [], "\n".join(found)


def test_a_pickle_planted_in_a_checkpoint_is_refused_not_run(tmp_path):
    """The one torch.load of a run-directory file (optimizer state on resume) must not execute what it reads."""
    from test_train import make_train_run, torchrun

    config, names = make_train_run(tmp_path / "run", "train.epochs=1")
    torchrun(config, names, nproc=1)
    run = Path(config.run_dir)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    canary = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    target = Path(latest["path"]) / "optimizer.pt"
    torch.save({"state": {}, "param_groups": [], "extra": Payload()}, target)
    with pytest.raises(AssertionError) as failed:
        torchrun(config, names, nproc=1)
    assert not canary.exists(), "resuming executed code from a pickle in the run directory"
    assert "optimizer.pt: refusing to load" in str(failed.value), str(failed.value)[-2000:]


def test_servers_default_to_loopback():
    from eagle3.config import PipelineConfig
    from eagle3.serving.managed import ManagedServer, build_argv

    config = PipelineConfig()
    assert config.server.host == "127.0.0.1"
    assert config.train.rdzv_endpoint == ""  # single node: torchrun --standalone, rendezvous on localhost
    assert ManagedServer.__init__.__kwdefaults__["host"] == "127.0.0.1"
    argv = build_argv(["vllm", "serve"], "m", config.server.host, 8000, None, [])
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    ui = (ROOT / "scripts" / "ui.sh").read_text()
    assert 'HOST="${EAGLE3_UI_HOST:-127.0.0.1}"' in ui


def test_a_moved_run_dir_resumes_and_exports_from_its_own_checkpoints(tmp_path):
    """latest.json / best.json record absolute paths; a moved run must not read the old place
    (gone, or another run's)."""
    import shutil

    from eagle3.export.stage import find_checkpoint
    from test_train import make_train_run, torchrun

    config, names = make_train_run(tmp_path / "old", "train.epochs=1")
    torchrun(config, names, nproc=1)
    old = Path(config.run_dir)
    new = tmp_path / "moved"
    shutil.move(old, new)
    moved = config.model_copy(update={"run_dir": str(new)})
    out = torchrun(moved, names, nproc=1)
    assert f"resumed from {new / 'checkpoints'}" in out.stdout + out.stderr
    path, _, how = find_checkpoint(new)
    assert how == "best.json" and path.parent == new / "checkpoints"
