import tomllib

import pytest

from conftest import ROOT
from eagle3.config import (
    DEMO_RECIPE,
    RECIPES_DIR,
    ConfigError,
    PipelineConfig,
    load_config,
    parse_set,
    section_hash,
    to_toml,
)


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_real_model_defaults():
    config = load_config()
    assert config.server.model == "meta-llama/Llama-3.1-8B-Instruct" and not config.server.model.startswith("tiny:")
    assert config.server.args == [] and config.server.env == {} and config.server.python is None
    assert config.server.reasoning_parser == "auto"
    assert (config.train.ttt_steps, config.train.learning_rate, config.train.epochs, config.train.batch_tokens) == (
        7,
        1e-4,
        2,
        16384,
    )
    assert config.server.host == "127.0.0.1"


def test_a_tiny_target_no_longer_switches_training_values():
    """The demo's training values come from its recipe, never from the model's name."""
    config = load_config(None, ['server.model="tiny:qwen3"'])
    assert (config.train.learning_rate, config.train.epochs, config.train.batch_tokens, config.train.ttt_steps) == (
        1e-4,
        2,
        16384,
        7,
    )


def test_the_demo_recipe_holds_the_demo_values():
    config = load_config(DEMO_RECIPE)
    assert config.data.source == "builtin:demo_prompts" and config.server.model == "tiny:qwen3"
    assert config.server.python == ".venv-vllm/bin/python" and "--enforce-eager" in config.server.args
    assert (config.train.learning_rate, config.train.epochs, config.train.batch_tokens, config.train.ttt_steps) == (
        3e-3,
        10,
        2048,
        3,
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_recipe_parses_and_says_why(recipe):
    load_config(recipe)
    text = recipe.read_text()
    assert text.lstrip().startswith("#"), f"{recipe.name} opens with what it is for"
    unexplained, explained_by_block = [], False
    for line in text.splitlines():
        bare = line.strip()
        if not bare or bare.startswith("["):
            explained_by_block = False
        elif bare.startswith("#"):
            explained_by_block = True  # a comment explains the run of values right below it
        elif "=" in bare and "#" not in bare and not explained_by_block:
            unexplained.append(bare)
    assert unexplained == [], f"{recipe.name}: values without a reason: {unexplained}"


def test_make_demo_runs_the_demo_recipe():
    makefile = (ROOT / "Makefile").read_text()
    assert "--config recipes/tiny-demo.toml" in makefile


def test_prefect_form_shows_the_real_defaults():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline_flow

    schema = parameter_schema(pipeline_flow.fn).model_dump()
    assert schema["properties"]["config"]["default"] == PipelineConfig().model_dump(mode="json")
    train = schema["definitions"]["TrainConfig"]["properties"]
    assert train["learning_rate"]["default"] == 1e-4 and train["ttt_steps"]["default"] == 7


def test_prefect_form_offers_the_training_data_knobs_with_descriptions():
    """Issue 16's knobs reach the form a user fills in the Prefect UI, each with its explanation."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline_flow

    definitions = parameter_schema(pipeline_flow.fn).model_dump()["definitions"]
    gen, data = definitions["GenerationConfig"]["properties"], definitions["DataConfig"]["properties"]
    for key in (
        "samples_per_prompt",
        "temperatures",
        "top_ps",
        "chat_template_kwargs",
        "reasoning_efforts",
        "partial_conversations",
        "reasoning",
    ):
        assert len(gen[key].get("description", "")) > 40, key
    assert set(gen["reasoning"]["enum"]) == {"keep", "drop", "disable"}
    assert "regenerate" in data["turns"]["enum"] and "regenerate" in data["turns"]["description"]
    for key in ("preset", "preset_source", "subset", "streaming", "mix"):
        assert len(data[key].get("description", "")) > 40, key


def test_every_knob_is_documented():
    undocumented = []
    for section_name, section in PipelineConfig.model_fields.items():
        if not section.description and not hasattr(section.annotation, "model_fields"):
            undocumented.append(section_name)
        for key, field in getattr(section.annotation, "model_fields", {}).items():
            if not (field.description and len(field.description) > 15):
                undocumented.append(f"{section_name}.{key}")
    assert undocumented == []


def test_unknown_key_in_file_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "[generation]\nconcurency = 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert str(path) in msg and "generation.concurency: unknown key" in msg
    assert "did you mean generation.concurrency" in msg


def test_unknown_section_and_bad_value_are_both_reported(tmp_path):
    path = write(tmp_path, "[genration]\nx = 1\n[data]\nnum_shards = 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "genration: unknown key (did you mean generation?)" in msg
    assert "data.num_shards: Input should be greater than or equal to 1" in msg


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[data\nsource = 1\n")
    with pytest.raises(ConfigError, match=r"run\.toml: not valid TOML"):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nope.toml"):
        load_config("nope.toml")


@pytest.mark.parametrize(
    "item, expected",
    [
        ("generation.concurrency=64", 64),
        ("generation.keep_truncated=false", False),
        ('server.args=["--max-num-seqs", "8"]', ["--max-num-seqs", "8"]),
        ('data.source="a b.jsonl"', "a b.jsonl"),
        ("data.source=prompts.jsonl", "prompts.jsonl"),
        ("generation.temperature=0.25", 0.25),
    ],
)
def test_set_reads_toml_literals_else_strings(item, expected):
    keys, value = parse_set(item)
    assert value == expected
    config = load_config(None, [item])
    node = config
    for key in keys:
        node = getattr(node, key)
    assert node == expected


def test_set_overrides_file_and_names_itself_on_error(tmp_path):
    path = write(tmp_path, "[generation]\nconcurrency = 8\n")
    assert load_config(path, ["generation.concurrency=16"]).generation.concurrency == 16
    with pytest.raises(ConfigError, match=r"--set generation\.concurency=3: generation\.concurency: unknown key"):
        load_config(path, ["generation.concurency=3"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(path, ["generation.concurrency"])
    with pytest.raises(ConfigError, match="'concurrency' is a value, not a section"):
        load_config(path, ["generation.concurrency.x=2"])


def test_server_urls_must_be_openai_base_urls():
    assert load_config(None, ['server.urls=["http://h:8000/v1"]']).server.urls == ["http://h:8000/v1"]
    with pytest.raises(ConfigError, match="must be an OpenAI base URL ending in /v1"):
        load_config(None, ['server.urls=["http://h:8000"]'])


def test_literal_choices_are_enforced():
    with pytest.raises(ConfigError, match="tokenize.overflow"):
        load_config(None, ["tokenize.overflow=wrap"])


def test_show_round_trips(tmp_path):
    config = load_config(
        None, ["data.limit=10", "generation.concurrency=3", 'server.args=["--a"]', "extract.layer_ids=[1, 2, 3]"]
    )
    text = to_toml(config, docs=True)
    assert "# Read at most this many source rows" in text
    again = load_config(write(tmp_path, text))
    assert again == config
    assert tomllib.loads(to_toml(config))["generation"]["concurrency"] == 3


def test_section_hash_tracks_values():
    a, b = load_config(), load_config(None, ["data.seed=1"])
    assert section_hash(a.data) != section_hash(b.data)
    assert section_hash(a.generation) == section_hash(b.generation)


def test_config_reference_doc_is_current():
    doc = (ROOT / "docs" / "config-reference.toml").read_text()
    assert doc == to_toml(load_config(), docs=True), (
        "regenerate: eagle3 config show --docs > docs/config-reference.toml"
    )


def test_deployments_carry_the_demo_recipe():
    """prefect.yaml repeats the demo recipe's values (a deployment cannot name a file): keep them equal."""
    import yaml

    recipe = load_config(DEMO_RECIPE)
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        tree = deployment["parameters"]["config"]
        config = PipelineConfig.model_validate({**tree, "run_dir": recipe.run_dir})
        assert config == recipe, deployment["name"]


def test_the_old_hidden_states_section_is_read_as_extract_with_a_warning(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('[hidden_states]\nmode = "online"\n')
    with pytest.warns(FutureWarning, match=r"\[hidden_states\] is deprecated: rename it to \[extract\]"):
        config = load_config(path)
    assert config.extract.mode == "online"
    path.write_text('[hidden_states]\nmode = "online"\n[extract]\nmode = "offline"\n')
    with pytest.raises(ConfigError, match="hidden_states is the old name of extract"):
        load_config(path)
