"""Export layouts (vllm / speculators / sglang) of a drafter checkpoint built from the tiny targets.

No vLLM here: the layouts are checked against what vLLM's and SGLang's loaders read (see
eagle3/export/layouts/); tests/integration/test_live_eval.py serves them for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3.export.layouts import (
    ExportError,
    UnsupportedLayout,
    export_checkpoint,
    read_target_config,
    validate_export,
    write_untrained_checkpoint,
)
from eagle3.run_facts import RunFacts
from eagle3.tiny import ensure_tiny

H, V, L = 128, 4096, 4
DRAFT_IDS = list(range(0, V, 2))  # a non-identity draft vocabulary: every second target id


@pytest.fixture(scope="module")
def targets():
    return {arch: ensure_tiny(arch) for arch in ("qwen3", "llama")}


def _formats(arch: str) -> list[str]:
    return ["vllm", "speculators"] + (["sglang"] if arch == "llama" else [])


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _target_tensor(target, name: str) -> torch.Tensor:
    with safe_open(str(Path(target) / "model.safetensors"), framework="pt") as fh:
        return fh.get_tensor(name)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _exported(tmp_path: Path, target, *, draft_ids=None, formats=("vllm", "speculators"), aux=(1, 2, 3)):
    ckpt = write_untrained_checkpoint(target, tmp_path / "ckpt", draft_ids=draft_ids, aux_layer_ids=list(aux))
    return ckpt, export_checkpoint(ckpt, target, tmp_path / "export", list(formats))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("identity", [True, False], ids=["identity-vocab", "draft-vocab"])
def test_round_trip(tmp_path, targets, arch, identity):
    target = targets[arch]
    ckpt, out = _exported(tmp_path, target, draft_ids=None if identity else DRAFT_IDS, formats=_formats(arch))
    D = V if identity else len(DRAFT_IDS)
    source = load_file(str(ckpt / "model.safetensors"))
    assert "embed_tokens.weight" not in source
    assert set(out) == set(_formats(arch))

    for layout, folder in out.items():
        assert validate_export(folder, layout, target) == [], layout
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "export_info.json", "model.safetensors"]
        tensors = _tensors(folder)
        prefix = "layers.0." if layout == "speculators" else "midlayer."
        # Every checkpoint tensor is there under the layout's name, bf16 for floats, bit-equal after the cast.
        for name, value in source.items():
            if name == "d2t" and identity:
                assert "d2t" not in tensors  # vLLM has no draft_id_to_target_id parameter for an identity vocab
                continue
            key = prefix + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
            got = tensors[key]
            if value.is_floating_point():
                assert got.dtype == torch.bfloat16, key
                assert torch.equal(got, value.to(torch.bfloat16)), key
            else:
                assert got.dtype == value.dtype and torch.equal(got, value), key
        if layout == "speculators":  # the target's whole table: speculators' loader does not fill it
            assert torch.equal(
                tensors["embed_tokens.weight"], _target_tensor(target, "model.embed_tokens.weight").to(torch.bfloat16)
            )
        else:
            assert "embed_tokens.weight" not in tensors
        assert tensors["fc.weight"].shape == (H, 3 * H)
        assert tensors[f"{prefix}self_attn.q_proj.weight"].shape[1] == 2 * H
        assert tensors["lm_head.weight"].shape == (D, H)
        assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == D
        has_qk_norm = f"{prefix}self_attn.q_norm.weight" in tensors
        assert has_qk_norm == (arch == "qwen3")
        if not identity:
            d2t = tensors["d2t"]
            assert d2t.dtype == torch.int64 and d2t.shape == (D,)
            assert torch.equal(torch.arange(D) + d2t, torch.tensor(DRAFT_IDS))
            # lm_head rows are the target's rows of the draft ids (as training initialises them)
            head = _target_tensor(target, "lm_head.weight")
            assert torch.equal(tensors["lm_head.weight"], head[torch.tensor(DRAFT_IDS)].float().to(torch.bfloat16))

        info = json.loads((folder / "export_info.json").read_text())
        assert info["layout"] == layout and info["aux_layer_ids_vllm_numbering"] == [1, 2, 3]


LAYER_KEYS = {
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "torch_dtype",
}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_config_keys(tmp_path, targets, arch):
    target = targets[arch]
    tcfg = read_target_config(target)
    _, out = _exported(tmp_path, target, draft_ids=DRAFT_IDS, formats=_formats(arch))
    rope = tcfg["rope_parameters"]["rope_theta"]

    eagle = _config(out["vllm"])
    assert LAYER_KEYS <= set(eagle)
    assert eagle["architectures"] == (["Eagle3Qwen3ForCausalLM"] if arch == "qwen3" else ["LlamaForCausalLMEagle3"])
    assert eagle["model_type"] == arch
    assert (eagle["hidden_size"], eagle["target_hidden_size"], eagle["vocab_size"], eagle["draft_vocab_size"]) == (
        H,
        H,
        V,
        len(DRAFT_IDS),
    )
    assert (
        eagle["intermediate_size"],
        eagle["num_attention_heads"],
        eagle["num_key_value_heads"],
        eagle["head_dim"],
    ) == (tcfg["intermediate_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["head_dim"])
    assert eagle["num_hidden_layers"] == 1 and eagle["tie_word_embeddings"] is False
    assert eagle["rope_theta"] == rope and eagle["rope_parameters"] == {"rope_type": "default", "rope_theta": rope}
    assert eagle["torch_dtype"] == "bfloat16"
    assert eagle["norm_before_residual"] is False  # written explicitly: the layouts' defaults differ
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert eagle["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}

    spec = _config(out["speculators"])
    assert spec["speculators_model_type"] == "eagle3"
    assert LAYER_KEYS <= set(spec["transformer_layer_config"])
    assert spec["transformer_layer_config"]["model_type"] == arch
    assert spec["norm_before_residual"] is False
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (spec["draft_vocab_size"], spec["target_hidden_size"]) == (len(DRAFT_IDS), H)
    method = spec["speculators_config"]["proposal_methods"][0]
    assert method["speculative_tokens"] == 3 and spec["speculators_config"]["verifier"]["name_or_path"] == str(target)
    # what speculators' own converter writes (top level, as its config's pydantic fields serialise)
    from importlib import metadata

    assert (spec["norm_before_fc"], spec["fc_norm"], spec["norm_output"], spec["embed_requires_grad"]) == (
        False,
        False,
        False,
        False,
    )
    assert spec["speculators_version"] == "0.9.0" and spec["transformers_version"] == metadata.version("transformers")

    if arch == "llama":
        sg = _config(out["sglang"])
        assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["model_type"] == "llama"
        # SGLang numbering: its id j is decoder layer j's output = vLLM id j + 1
        assert sg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
        assert "eagle_aux_hidden_state_layer_ids" not in sg
        assert sg["num_hidden_layers"] == 1 and sg["draft_vocab_size"] == len(DRAFT_IDS)


def test_sglang_refuses_what_it_cannot_serve(tmp_path, targets):
    ckpt = write_untrained_checkpoint(targets["qwen3"], tmp_path / "q")
    with pytest.raises(UnsupportedLayout, match="q_norm"):
        export_checkpoint(ckpt, targets["qwen3"], tmp_path / "out", ["vllm", "sglang"])
    assert not (tmp_path / "out" / "vllm").exists()  # nothing written when a layout is refused
    last = write_untrained_checkpoint(targets["llama"], tmp_path / "l", aux_layer_ids=[1, 2, L])
    with pytest.raises(UnsupportedLayout, match="SGLang captures"):
        export_checkpoint(last, targets["llama"], tmp_path / "out", ["sglang"])
    assert export_checkpoint(last, targets["llama"], tmp_path / "out", ["vllm"])  # vLLM numbering reaches layer L


def test_checkpoint_must_fit_target(tmp_path, targets):
    ckpt = write_untrained_checkpoint(targets["qwen3"], tmp_path / "ckpt")
    cfg = json.loads((ckpt / "drafter_config.json").read_text())
    (ckpt / "drafter_config.json").write_text(json.dumps({**cfg, "aux_layer_ids": [1, 2, 9]}))
    with pytest.raises(ExportError, match="aux layer ids"):
        export_checkpoint(ckpt, targets["qwen3"], tmp_path / "out", ["vllm"])
    with pytest.raises(ExportError, match="lacks"):
        export_checkpoint(tmp_path / "nowhere", targets["qwen3"], tmp_path / "out", ["vllm"])


def _rewrite(folder: Path, change) -> None:
    tensors = _tensors(folder)
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _edit_config(folder: Path, change) -> None:
    cfg = _config(folder)
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_validate_catches_wrong_shape(tmp_path, targets, layout):
    _, out = _exported(tmp_path, targets["qwen3"], draft_ids=DRAFT_IDS, formats=[layout])
    _rewrite(out[layout], lambda t: t.update({"fc.weight": t["fc.weight"][:, : 2 * H].clone()}))
    problems = validate_export(out[layout], layout, targets["qwen3"])
    assert any("fc.weight" in p and "shape" in p for p in problems), problems


def test_validate_checks_the_speculators_embedding(tmp_path, targets):
    target = targets["qwen3"]
    _, out = _exported(tmp_path, target, draft_ids=DRAFT_IDS, formats=["speculators"])
    folder = out["speculators"]
    assert validate_export(folder, "speculators", target) == []

    def swap_two_rows(t):
        embed = t["embed_tokens.weight"].clone()
        embed[[5, 9]] = embed[[9, 5]]
        t["embed_tokens.weight"] = embed

    _rewrite(folder, swap_two_rows)
    assert validate_export(folder, "speculators", target) == [
        "embed_tokens.weight: 2 rows differ from the target's embedding"
    ]
    _rewrite(folder, lambda t: t.pop("embed_tokens.weight"))
    assert validate_export(folder, "speculators", target) == ["missing tensor embed_tokens.weight"]


def test_validate_catches_out_of_range_d2t(tmp_path, targets):
    _, out = _exported(tmp_path, targets["llama"], draft_ids=DRAFT_IDS, formats=["vllm"])

    def bump(t):
        d2t = t["d2t"].clone()
        d2t[-1] = V  # last draft id now maps past the target vocabulary
        t["d2t"] = d2t

    _rewrite(out["vllm"], bump)
    problems = validate_export(out["vllm"], "vllm", targets["llama"])
    assert any("d2t" in p and "outside" in p for p in problems), problems


def test_validate_catches_bad_vocab_maps_and_dtypes(tmp_path, targets):
    _, out = _exported(tmp_path, targets["qwen3"], formats=["vllm"])  # identity vocab: no d2t
    folder = out["vllm"]
    _rewrite(folder, lambda t: t.update({"d2t": torch.zeros(V, dtype=torch.int64)}))
    assert any("unexpected tensor d2t" in p for p in validate_export(folder, "vllm", targets["qwen3"]))
    _rewrite(folder, lambda t: (t.pop("d2t"), t.update({"norm.weight": t["norm.weight"].float()})))
    assert any("norm.weight" in p and "dtype" in p for p in validate_export(folder, "vllm", targets["qwen3"]))
    _rewrite(
        folder, lambda t: (t.update({"norm.weight": t["norm.weight"].to(torch.bfloat16)}), t.pop("lm_head.weight"))
    )
    assert "missing tensor lm_head.weight" in validate_export(folder, "vllm", targets["qwen3"])


def test_validate_catches_config_problems(tmp_path, targets):
    target = targets["qwen3"]
    _, out = _exported(tmp_path, target, formats=["vllm", "speculators"])
    vllm, spec = out["vllm"], out["speculators"]

    _edit_config(vllm, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [1, 2, 2]}))
    assert any("differs from the top-level" in p for p in validate_export(vllm, "vllm", target))
    _edit_config(
        vllm,
        lambda c: (
            c.update({"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}),
            c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}),
        ),
    )
    assert any("outside 1..4" in p for p in validate_export(vllm, "vllm", target))
    _edit_config(
        vllm,
        lambda c: (
            c.update({"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}),
            c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}),
        ),
    )
    assert any("distinct" in p for p in validate_export(vllm, "vllm", target))
    _edit_config(vllm, lambda c: c.pop("norm_before_residual"))
    assert "config.json lacks norm_before_residual" in validate_export(vllm, "vllm", target)

    _edit_config(spec, lambda c: c["transformer_layer_config"].update({"vocab_size": 5000}))
    assert any("vocab_size=5000" in p for p in validate_export(spec, "speculators", target))
    _edit_config(spec, lambda c: c["speculators_config"].pop("verifier"))
    assert any("verifier" in p for p in validate_export(spec, "speculators", target))
    _edit_config(spec, lambda c: c.update({"fc_norm": True, "embed_requires_grad": "no"}))
    problems = validate_export(spec, "speculators", target)
    assert any(p.startswith("fc_norm=True") for p in problems) and any("embed_requires_grad" in p for p in problems)
    _edit_config(spec, lambda c: c.pop("speculators_version"))
    assert "config.json lacks speculators_version" in validate_export(spec, "speculators", target)
    assert validate_export(tmp_path / "nothing", "vllm", target) == [f"{tmp_path / 'nothing' / 'config.json'} missing"]


# -- the stage ------------------------------------------------------------------------------


def _run_config(tmp_path: Path, model: str = "tiny:qwen3", *sets: str):
    from eagle3.config import DEMO_RECIPE, load_config

    return load_config(DEMO_RECIPE, [f'run_dir="{tmp_path / "run"}"', f'server.model="{model}"', *sets])


def test_run_export_picks_best_and_skips_sglang_for_qwen3(tmp_path, targets):
    from eagle3.export.stage import MissingCheckpoint, run_export
    from eagle3.manifest import read_manifest

    config = _run_config(tmp_path)
    facts = RunFacts.resolve(config)
    ckpts = tmp_path / "run" / "checkpoints"
    with pytest.raises(MissingCheckpoint, match=str(ckpts)):
        run_export(facts)
    write_untrained_checkpoint(targets["qwen3"], ckpts / "step-000010", seed=1)
    write_untrained_checkpoint(targets["qwen3"], ckpts / "step-000020", seed=2)
    (ckpts / "step-000030").mkdir()  # a checkpoint being written: no files yet, never chosen

    entry = run_export(facts)
    assert entry["step"] == 20 and entry["chosen_by"] == "highest step"
    assert set(entry["paths"]) == {"vllm", "speculators"} and set(entry["skipped"]) == {"sglang"}
    stage = read_manifest(tmp_path / "run")["stages"]["export"]
    assert (stage["in"], stage["ok"], stage["filtered"], stage["failed"]) == (3, 2, 1, 0)

    (ckpts / "best.json").write_text(
        json.dumps({"step": 10, "path": str(ckpts / "step-000010"), "acceptance_length": 1.5})
    )
    entry = run_export(facts)
    assert entry["step"] == 10 and entry["chosen_by"] == "best.json" and entry["reused"] == []
    exported = _tensors(Path(entry["paths"]["vllm"]))
    assert torch.equal(
        exported["fc.weight"],
        load_file(str(ckpts / "step-000010" / "model.safetensors"))["fc.weight"].to(torch.bfloat16),
    )
    assert run_export(facts)["reused"] == ["vllm", "speculators"]  # same bytes: kept

    (ckpts / "best.json").write_text(
        json.dumps({"step": 40, "path": str(ckpts / "step-000040"), "acceptance_length": 2.0})
    )
    with pytest.raises(MissingCheckpoint, match="step-000040"):
        run_export(facts)


def test_run_export_llama_all_layouts(tmp_path, targets):
    from eagle3.export.stage import run_export

    config = _run_config(tmp_path, "tiny:llama", 'export.formats=["vllm", "sglang", "speculators"]')
    facts = RunFacts.resolve(config)
    write_untrained_checkpoint(targets["llama"], tmp_path / "run" / "checkpoints" / "step-000001", draft_ids=DRAFT_IDS)
    entry = run_export(facts)
    assert set(entry["paths"]) == {"vllm", "sglang", "speculators"} and entry["skipped"] == {}


# -- evaluate helpers (no vLLM) ---------------------------------------------------------------

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/m/tiny"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/m/tiny"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m/tiny"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m/tiny"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/tiny",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/tiny",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m/tiny",position="1"} 4.0
vllm:num_requests_running{engine="0",model_name="/m/tiny"} 0.0
"""


def test_parse_spec_metrics_and_delta():
    from eagle3.evaluate.live import metrics_delta, parse_spec_metrics

    after = parse_spec_metrics(METRICS)
    assert after == {
        "drafts": 10.0,
        "draft_tokens": 30.0,
        "accepted_tokens": 12.0,
        "accepted_per_pos": [7.0, 4.0, 1.0],
        "found": True,
    }
    before = parse_spec_metrics("")
    assert before["found"] is False and before["accepted_per_pos"] == []
    d = metrics_delta(before, after)
    assert d["mean_acceptance_length"] == pytest.approx(2.2) and d["acceptance_rate"] == pytest.approx(0.4)
    assert d["per_position_acceptance"] == pytest.approx([0.7, 0.4, 0.1])
    assert metrics_delta(after, after)["mean_acceptance_length"] is None


def test_select_prompts_heldout_then_top_up(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3.evaluate.live import select_prompts
    from eagle3.train.split import is_heldout

    folder = tmp_path / "prompts"
    folder.mkdir()
    ids = [f"p{i}" for i in range(40)]
    for shard in range(2):
        part = ids[shard::2]
        pq.write_table(
            pa.table({"id": part, "messages": [[{"role": "user", "content": f"hi {i}"}] for i in part]}),
            folder / f"shard-{shard:05d}.parquet",
        )
    heldout = [i for i in ids if is_heldout(i, 0.25)]
    assert 0 < len(heldout) < 30
    few, info = select_prompts(tmp_path, 0.25, 3)
    assert len(few) == 3 and all(is_heldout(p["id"], 0.25) for p in few) and "note" not in info
    many, info = select_prompts(tmp_path, 0.25, 30)
    assert (
        len(many) == 30
        and info["heldout_used"] == len(heldout)
        and info["topped_up_from_training"] == 30 - len(heldout)
    )
    assert "note" in info and [p["id"] for p in many] == [p["id"] for p in select_prompts(tmp_path, 0.25, 30)[0]]
    assert many[0]["messages"] == [{"role": "user", "content": f"hi {many[0]['id']}"}]


def test_run_export_records_an_invalid_export(tmp_path, targets, monkeypatch):
    from eagle3.export import stage
    from eagle3.manifest import read_manifest

    config = _run_config(tmp_path, "tiny:qwen3", 'export.formats=["vllm"]')
    facts = RunFacts.resolve(config)
    write_untrained_checkpoint(targets["qwen3"], tmp_path / "run" / "checkpoints" / "step-000001")
    monkeypatch.setattr(
        stage, "validate_export", lambda folder, layout, target: ["fc.weight: shape (1,), expected (128, 384)"]
    )
    with pytest.raises(stage.InvalidExport, match="fc.weight"):
        stage.run_export(facts)
    entry = read_manifest(tmp_path / "run")["stages"]["export"]
    assert entry["status"] == "failed" and (entry["in"], entry["ok"], entry["failed"]) == (1, 0, 1)


def test_the_export_marker_decides_what_is_reused(tmp_path, targets):
    """RUN/export/done.json (the one marker protocol) vouches for the layouts it lists, for these
    checkpoint bytes; without it (a kill mid-rewrite, or a run dir of an earlier release) every
    layout is written again."""
    from eagle3.export.stage import run_export
    from eagle3.markers import read_marker

    config = _run_config(tmp_path)
    facts = RunFacts.resolve(config)
    ckpts = tmp_path / "run" / "checkpoints"
    write_untrained_checkpoint(targets["qwen3"], ckpts / "step-000010", seed=1)
    assert run_export(facts)["reused"] == []
    marker = read_marker(tmp_path / "run" / "export" / "done.json", "export")
    assert set(marker["paths"]) == {"vllm", "speculators"} and marker.counts["filtered"] == 1 and marker.key
    assert run_export(facts)["reused"] == ["vllm", "speculators"]
    (tmp_path / "run" / "export" / "done.json").unlink()  # export_info.json alone no longer vouches
    assert run_export(facts)["reused"] == []
    write_untrained_checkpoint(targets["qwen3"], ckpts / "step-000020", seed=2)  # new bytes: a new key
    entry = run_export(facts)
    assert entry["reused"] == [] and entry["step"] == 20
    assert read_marker(tmp_path / "run" / "export" / "done.json", "export").key != marker.key


def test_eagle31_norms_are_exported_validated_and_refused_by_sglang(tmp_path, targets):
    target = targets["llama"]
    ckpt = write_untrained_checkpoint(
        target, tmp_path / "ckpt", aux_layer_ids=[1, 2, 3], norm_before_fc=True, norm_output=True
    )
    source = load_file(str(ckpt / "model.safetensors"))
    assert source["input_norm.weight"].shape == (3 * H,)
    out = export_checkpoint(ckpt, target, tmp_path / "export", ["vllm", "speculators"])
    for layout, folder in out.items():
        assert validate_export(folder, layout, target) == [], layout
        cfg = _config(folder)
        assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True, layout
        assert torch.equal(_tensors(folder)["input_norm.weight"], source["input_norm.weight"].to(torch.bfloat16))
    assert _config(out["vllm"])["eagle_config"]["norm_before_fc"] is True
    # a config that says norm_before_fc but lacks the norm's weight is caught, and the other way round
    _edit_config(
        out["vllm"], lambda c: c["eagle_config"].update(norm_before_fc=False) or c.update(norm_before_fc=False)
    )
    assert any("input_norm.weight" in p for p in validate_export(out["vllm"], "vllm", target))
    with pytest.raises(UnsupportedLayout, match="norm_before_fc"):
        export_checkpoint(ckpt, target, tmp_path / "sglang", ["sglang"])
    plain = write_untrained_checkpoint(target, tmp_path / "plain", aux_layer_ids=[1, 2, 3])
    folder = export_checkpoint(plain, target, tmp_path / "plain-export", ["vllm"])["vllm"]
    assert _config(folder)["norm_before_fc"] is False and "input_norm.weight" not in _tensors(folder)
