"""The run's facts (eagle3/run_facts.py): resolved once from the config and the target's files, read
by each stage through the object it is handed, and a clear error for a fact whose stage has not run."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from eagle3.errors import MissingInputError, UserError
from eagle3.layout import RunLayout
from eagle3.manifest import record_stage
from eagle3.models import ModelNotFoundError, template_hash
from eagle3.prepare.stage import run_prepare
from eagle3.results import StageCounts
from eagle3.run_facts import RunFacts
from eagle3.schemas import TokenizerMismatchError, tokenizer_hash
from eagle3.tiny import ensure_tiny

NAMES = ["shard-00000.parquet", "shard-00001.parquet"]


def test_resolve_on_the_demo_config(demo_config):
    config = demo_config()
    facts = RunFacts.resolve(config)
    tiny = str(ensure_tiny("qwen3"))
    assert facts.config is config and facts.layout == RunLayout.of(config)
    assert facts.target_path == facts.model_dir() == tiny
    assert facts.tokenizer() == (tiny, tokenizer_hash(tiny)) and facts.tokenizer_hash
    assert facts.expected_target() == (tiny, template_hash(tiny)) and facts.template_hash
    assert facts.target_shape() == (4, 128)
    assert facts.layer_ids == [1, 2, 3]  # the default for a 4-layer target
    assert facts.request_plan == {"regenerate": False, "extras": None}
    assert RunFacts.resolve(demo_config("extract.layer_ids=[1, 3, 4]")).layer_ids == [1, 3, 4]


def test_resolving_loads_no_torch_and_touches_no_network(tmp_path):
    code = (
        "import sys\n"
        "from eagle3.config import DEMO_RECIPE, load_config\n"
        "from eagle3.run_facts import RunFacts\n"
        f"RunFacts.resolve(load_config(DEMO_RECIPE, ['run_dir=\"{tmp_path / 'run'}\"']))\n"
        "assert not {'torch', 'transformers', 'vllm'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_an_external_server_resolves_without_the_models_files(demo_config, monkeypatch, tmp_path):
    """An external target named by a hub id the cache lacks: nothing is fetched, the name is the server's."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sets = ('server.mode="external"', 'server.model="acme/not-cached"', 'server.urls=["http://127.0.0.1:9/v1"]')
    facts = RunFacts.resolve(demo_config(*sets))
    assert (facts.target_path, facts.tokenizer_path, facts.target_layers) == (None, None, None)
    assert facts.expected_target() == ("acme/not-cached", "")


def test_the_prompt_shards_after_prepare(demo_config):
    config = demo_config("data.num_shards=2")
    facts = RunFacts.resolve(config)  # before prepare: the facts that appear later are read when asked for
    result = run_prepare(config)
    shards = facts.prompt_shards()
    assert list(shards) == [facts.layout.prompt_shard(n) for n in NAMES]
    assert sum(shards.values()) == result.counts["ok"] and all(path.is_file() for path in shards)
    assert facts.shard_names() == NAMES
    assert facts.tokenized_done(NAMES[0]) is None and facts.states_done(NAMES[0]) is None


def test_a_fact_asked_for_before_its_stage_ran_names_the_marker(demo_config):
    facts = RunFacts.resolve(demo_config())
    with pytest.raises(MissingInputError) as caught:
        facts.shard_names("vocab")
    assert caught.value.path == str(facts.layout.prompts_marker)
    assert str(caught.value).startswith(f"vocab: {facts.layout.prompts_marker} not found: run the prepare stage")
    with pytest.raises(MissingInputError) as caught:
        facts.tokenized_marker(NAMES[0], "extract")
    assert caught.value.path == str(facts.layout.tokenized_files(NAMES[0])["done"])
    assert "run `eagle3 tokenize` first" in str(caught.value)
    with pytest.raises(MissingInputError, match=r"manifest.json has no extract stage: run `eagle3 extract` first"):
        facts.extracted_layer_ids()


def test_the_layer_ids_extraction_used_are_checked_against_the_config(demo_config):
    config = demo_config()
    record_stage(config.run_dir, "extract", StageCounts(1, 1), mode="offline", layer_ids=[1, 2, 3])
    assert RunFacts.resolve(config).extracted_layer_ids() == [1, 2, 3]
    other = RunFacts.resolve(demo_config("extract.layer_ids=[1, 3, 4]"))
    with pytest.raises(MissingInputError, match=r"extract.layer_ids \[1, 3, 4\] differ from the \[1, 2, 3\]"):
        other.extracted_layer_ids()


def test_facts_handed_down_are_used_and_foreign_ones_refused(demo_config, tmp_path):
    config = demo_config()
    facts = RunFacts.resolve(config)
    assert RunFacts.of(config, facts) is facts
    assert RunFacts.of(config) == facts  # resolved when not given
    other = RunFacts.resolve(demo_config("vocab.draft_vocab_size=64"))
    with pytest.raises(UserError, match="resolved for another config"):
        RunFacts.of(config, other)


def test_facts_pass_through_json_and_back(demo_config):
    """What the Prefect API stores for a flow run's ``facts`` parameter is enough to rebuild them."""
    facts = RunFacts.resolve(demo_config())
    assert RunFacts.model_validate_json(facts.model_dump_json()) == facts


def test_a_stage_reads_its_inputs_through_the_facts_it_is_handed(tmp_path, prefect_server):
    """The tokenize flow, given facts whose tokenizer hash is not the config's, records that hash (it
    reads the fact, it does not re-derive it); extraction handed the true facts then refuses the shard."""
    from eagle3.extract.stage import plan
    from flows.tokenize import tokenize_flow
    from test_tokenize import make_run, server_record

    config, _, _ = make_run(tmp_path, lambda k, row, tok: [server_record(k, row, tok)])
    true = RunFacts.resolve(config)
    handed = true.model_copy(update={"tokenizer_hash": "f" * 16})
    entry = tokenize_flow(config, handed)
    assert entry["ok"] == 6
    done = true.tokenized_done(NAMES[0])
    assert done["tokenizer_sha256"] == "f" * 16 and done["tokenizer"] == true.tokenizer_path
    assert Path(done.path).parent == true.layout.tokenized
    with pytest.raises(TokenizerMismatchError, match="the tokenizer changed between stages"):
        plan(true, [NAMES[0]])
    assert plan(handed, [NAMES[0]]).layer_ids == [1, 2, 3]  # the same facts as tokenize: no complaint


# -- the stages that read the target through the facts ---------------------------------------------------


@pytest.fixture
def handed_target(demo_config, monkeypatch, tmp_path):
    """(config, facts): a config whose server.model no local folder or cache holds (offline, an empty hub
    cache), and its facts with target_path handed down pointing at a tiny build's folder. A stage that
    resolved the config's model itself would fail with ModelNotFoundError; one that reads the facts works."""

    def make(arch: str, *sets: str, **facts_update):
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        config = demo_config('server.model="acme/not-cached"', *sets)
        alone = RunFacts.resolve(config)
        with pytest.raises(ModelNotFoundError, match="acme/not-cached"):
            alone.model_dir()
        return config, alone.model_copy(update={"target_path": str(ensure_tiny(arch)), **facts_update})

    return make


def test_self_prompts_plan_reads_the_target_template_through_the_facts(handed_target, demo_config):
    """The prefixes come from the handed folder's chat template (Qwen3's), not from tokenize.tokenizer
    (a Llama tokenizer here): the server renders the target's template."""
    from eagle3.prepare.self_prompts import make_plan

    source = 'data.source="self:prompts"'
    _, facts = handed_target("qwen3", source, 'tokenize.tokenizer="tiny:llama"')
    assert facts.tokenizer()[0] == str(ensure_tiny("llama"))
    plan = make_plan(facts)
    reference = make_plan(RunFacts.resolve(demo_config(source)))  # the demo's target is tiny:qwen3 itself
    assert plan.prefixes == reference.prefixes and plan.prefixes[0].stop == "<|im_end|>"
    assert plan.model == "acme/not-cached"  # the plan's key still names the configured model


def test_export_reads_the_target_folder_and_depth_through_the_facts(handed_target):
    """The layouts are written against the handed folder; the depth the layouts are checked against is the
    facts' (3 here, the folder's config says 4: SGLang's aux ids 1..2 then leave layer 3 out)."""
    from eagle3.export.layouts import write_untrained_checkpoint
    from eagle3.export.stage import run_export

    formats = 'export.formats=["vllm", "sglang", "speculators"]'
    config, facts = handed_target("llama", formats, target_layers=3, target_hidden=128)
    llama = facts.model_dir()
    write_untrained_checkpoint(llama, Path(config.run_dir) / "checkpoints" / "step-000001", aux_layer_ids=[1, 2, 3])
    entry = run_export(facts)
    assert entry["target"] == llama and set(entry["paths"]) == {"vllm", "speculators"}
    assert "only ids 1..2 exist there" in " ".join(entry["skipped"]["sglang"])


def test_evaluate_serves_and_builds_from_the_target_folder_of_the_facts(handed_target, tmp_path):
    """Every method's server loads the handed folder (told the configured name), and the untrained drafter
    is built from the same folder."""
    from eagle3.evaluate import servers
    from eagle3.export.layouts import export_checkpoint, validate_export, write_untrained_checkpoint

    _, facts = handed_target("qwen3")
    qwen3 = facts.model_dir()
    managed = servers.make_server(facts, "none", None, tmp_path / "server.log", None)
    assert (managed.model, managed.served_model_name) == (qwen3, "acme/not-cached")
    assert qwen3 in managed.argv
    ckpt = write_untrained_checkpoint(qwen3, tmp_path / "ckpt", aux_layer_ids=[1, 2, 3])
    trained = export_checkpoint(ckpt, qwen3, tmp_path / "export", ["vllm"])["vllm"]
    untrained = servers.build_untrained(facts, Path(trained), tmp_path / "out")
    assert validate_export(untrained, "vllm", qwen3) == []
