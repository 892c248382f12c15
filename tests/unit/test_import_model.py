"""eagle3 import-model on a small GGUF the test writes from the tiny Llama target (no download)."""

import json
import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tests"))
from eagle3.importer import MARKER, ImportModelError, find_gguf, greedy_tokens, import_model  # noqa: E402
from eagle3.tiny import ensure_tiny  # noqa: E402
from gguf_fixture import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(ensure_tiny("llama"), tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory):
    return import_model(str(tiny_gguf), tmp_path_factory.mktemp("models") / "tiny-imported", log=lambda *_: None)


def test_import_writes_a_plain_hf_folder_with_the_same_weights(imported):
    from safetensors.torch import load_file

    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (4, 128, 4096)
    ours, theirs = (
        load_file(str(imported / "model.safetensors")),
        load_file(str(ensure_tiny("llama") / "model.safetensors")),
    )
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], tensor), name
    assert (imported / "tokenizer.json").exists() and "<|start_header_id|>" in (
        imported / "chat_template.jinja"
    ).read_text()


def test_the_imported_folder_answers_as_the_gguf_model_does(tiny_gguf, imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.bfloat16
    )
    folder_model = AutoModelForCausalLM.from_pretrained(str(imported), dtype=torch.bfloat16)
    expected = greedy_tokens(gguf_model, tokenizer)
    assert len(expected) > 0 and greedy_tokens(folder_model, AutoTokenizer.from_pretrained(str(imported))) == expected
    marker = json.loads((imported / MARKER).read_text())
    assert marker["check_tokens"] == expected and marker["architecture"] == "llama" and marker["dtype"] == "bfloat16"


def test_a_second_import_does_nothing(tiny_gguf, imported):
    before = {p.name: p.stat().st_mtime_ns for p in imported.iterdir()}
    said = []
    assert import_model(str(tiny_gguf), imported, log=said.append) == imported
    assert {p.name: p.stat().st_mtime_ns for p in imported.iterdir()} == before
    assert "nothing to do" in said[0]


def test_missing_file_and_not_a_gguf_are_clear(tmp_path):
    with pytest.raises(ImportModelError, match=r"nope\.gguf does not exist"):
        import_model(str(tmp_path / "nope.gguf"), tmp_path / "out")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ImportModelError, match=r"fake\.gguf is not a GGUF file"):
        import_model(str(tmp_path / "fake.gguf"), tmp_path / "out")
    with pytest.raises(ImportModelError, match="neither a file nor an installed package"):
        find_gguf("no-such-package-eagle3")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(ensure_tiny("llama"), tmp_path / "odd.gguf", architecture="gpt2")
    with pytest.raises(ImportModelError, match=r"architecture 'gpt2' is not supported \(supported: llama, qwen3\)"):
        import_model(str(path), tmp_path / "out")


def test_not_enough_disk_is_refused_before_any_work(tiny_gguf, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ImportModelError, match=r"needs ~\d+ MiB, only 0 MiB free"):
        import_model(str(tiny_gguf), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_foreign_folder_is_never_overwritten(tiny_gguf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ImportModelError, match="exists and is not an earlier import"):
        import_model(str(tiny_gguf), tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_a_package_that_ships_one_gguf_is_found(tiny_gguf, tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "fake_weights").mkdir(parents=True)
    os.link(tiny_gguf, site / "fake_weights" / "model.gguf")
    info = site / "fake_weights-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-weights\nVersion: 0.1\n")
    (info / "RECORD").write_text("fake_weights/model.gguf,,\nfake_weights-0.1.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    assert find_gguf("fake-weights") == site / "fake_weights" / "model.gguf"


def test_the_cli_prints_one_line_for_a_bad_source(tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "cli", "import-model", str(tmp_path / "x.gguf"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr and "x.gguf does not exist" in result.stderr
