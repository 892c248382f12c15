import tomllib

import pytest

from eagle3.config import ConfigError, PipelineConfig, load_config, parse_set, section_hash, to_toml


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_demo():
    config = load_config()
    assert config.data.source == "builtin:demo_prompts"
    assert config.server.model == "tiny:qwen3"
    assert config.server.host == "127.0.0.1"


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
    config = load_config(None, ["data.limit=10", "generation.concurrency=3", 'server.args=["--a"]', "hidden_states.layer_ids=[1, 2, 3]"])
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
    from conftest import ROOT

    doc = (ROOT / "docs" / "config-reference.toml").read_text()
    assert doc == to_toml(load_config(), docs=True), "regenerate: eagle3 config show --docs > docs/config-reference.toml"
