"""Benchmark results people can trust: every file in benchmarks/results/ says which code, machine and
command made it and carries a summary of named numbers; the writer records all of that; the README's
tables are what the JSON says (benchmarks/table.py --check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks")]

import table  # noqa: E402

import results_file  # noqa: E402

FILES = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_results_file_carries_provenance_and_summary(path):
    data = json.loads(path.read_text())
    assert results_file.missing_fields(data) == [], f"{path.name}: rerun its benchmark (table.py --audit)"
    assert set(results_file.MACHINE_FIELDS) <= set(data["machine"])


def test_results_folder_is_not_empty():
    assert FILES, "benchmarks/results/ holds no JSON: the parametrized check above would pass vacuously"


def test_write_records_commit_date_machine_command_and_summary(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = tmp_path / "sub" / "unit.json"
    returned = results_file.write(out, "unit", {"stage_vs_bare": 0.93, "stage_aa": 1.01}, rows=[1, 2])
    data = json.loads(out.read_text())
    assert data == returned
    assert results_file.missing_fields(data) == []
    assert data["benchmark"] == "unit" and data["rows"] == [1, 2]
    assert data["summary"] == {"stage_vs_bare": 0.93, "stage_aa": 1.01}
    assert data["commit"].removesuffix("+dirty") == head
    assert data["date"].startswith("20") and "T" in data["date"]
    assert data["machine"]["cores"] >= 1 and data["machine"]["memory_bytes"] > 0
    assert data["command"].startswith("python ")
    assert not list(out.parent.glob(".*.tmp")), "the temporary file of the atomic replace was left behind"


@pytest.mark.parametrize(
    "summary",
    [{}, {"fastest": "trained_compiled"}, {"ratio": None}, {"ok": True}, {"a.b": 1.0}, {"per_c": {"64": 1.0}}],
    ids=["empty", "string", "null", "bool", "dotted-name", "nested"],
)
def test_write_refuses_a_summary_that_is_not_named_numbers(tmp_path, summary):
    with pytest.raises(ValueError, match="unit.summary"):
        results_file.write(tmp_path / "unit.json", "unit", summary)
    assert not (tmp_path / "unit.json").exists()


def test_aa_is_the_second_run_over_the_first():
    assert results_file.aa(2.0, 2.1) == 1.05
    assert results_file.aa(4.0, 4.0) == 1.0


def test_audit_names_a_results_file_that_lacks_its_commit(tmp_path):
    good = results_file.write(tmp_path / "good.json", "good", {"x_vs_y": 1.0})
    (tmp_path / "nocommit.json").write_text(json.dumps({k: v for k, v in good.items() if k != "commit"}))
    (tmp_path / "oldmachine.json").write_text(json.dumps({**good, "machine": "x86_64, 2 CPUs"}))
    (tmp_path / "broken.json").write_text("{not json")
    problems = table.audit(tmp_path.glob("*.json"))
    assert problems[0].startswith("broken.json: unreadable")
    assert problems[1] == "nocommit.json: lacks commit"
    assert problems[2].startswith("oldmachine.json: lacks machine.cores")
    assert len(problems) == 3, problems  # good.json has nothing to report


def test_readme_tables_match_the_committed_results():
    assert table.main(["--check"]) == 0, "benchmarks/README.md is stale: run benchmarks/table.py"


def test_check_fails_on_a_hand_edited_table_and_the_rewrite_restores_it(tmp_path, capsys):
    readme = tmp_path / "README.md"
    text = table.README.read_text()
    part = text.split("<!-- generated:summary begin -->", 1)[1].split("<!-- generated:summary end -->", 1)[0]
    readme.write_text(text.replace(part, "\n| benchmark | typed by hand |\n"))
    assert table.main(["--check", "--readme", str(readme)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert table.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == text


def test_check_fails_when_a_results_number_changes(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for path in FILES:
        (results / path.name).write_text(path.read_text())
    data = json.loads((results / "cluster.json").read_text())
    data["summary"] = {**data["summary"], "tokenize_ray_vs_local": 0.5}
    (results / "cluster.json").write_text(json.dumps(data))
    assert table.main(["--check", "--results", str(results)]) == 1


def test_a_readme_without_a_part_s_markers_is_an_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(table.README.read_text().replace("<!-- generated:cluster end -->", ""))
    with pytest.raises(ValueError, match="generated:cluster"):
        table.main(["--check", "--readme", str(readme)])
