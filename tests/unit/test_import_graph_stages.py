"""The two stage rules of test_import_graph.py (no module outside a stage's package imports its own
module; no flow or task imports another stage's flow or tasks), each shown failing on a small tree."""

from test_import_graph import _tree, across_stages, into_stage_modules, read_graph


def test_a_stage_reaching_into_another_stages_module_is_named(tmp_path):
    """Both stage rules on a small tree: eagle3/<stage>/ importing another stage's stage.py, and a flow
    taking a shard list from another stage's tasks module."""
    graph, _ = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/stage.py": "",
            "pkg/a/data.py": "from pkg.a.stage import x\n",  # its own stage: fine
            "pkg/b/__init__.py": "",
            "pkg/b/stage.py": "",
            "pkg/b/data.py": "def f():\n    from pkg.a.stage import shards\n",
        },
    )
    assert into_stage_modules(graph, {"pkg.a.stage": "pkg.a", "pkg.b.stage": "pkg.b"}) == [
        "pkg.b.data -> pkg.a.stage: pkg/b/data.py:2 imports pkg.a.stage inside a function"
    ]
    (tmp_path / "flows").mkdir()
    (tmp_path / "tasks").mkdir()
    files = {
        "flows/__init__.py": "",
        "tasks/__init__.py": "",
        "tasks/a.py": "",
        "tasks/b.py": "",
        "tasks/retry.py": "",
        "flows/a.py": "from tasks.a import t\nfrom tasks.retry import r\n",  # its own tasks, a shared helper
        "flows/b.py": "from tasks.a import shard_names\nfrom tasks.b import t\n",
        "flows/pipeline.py": "from flows.a import a_flow\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph, _ = read_graph(tmp_path, ("flows", "tasks"))
    assert across_stages(graph, ["a", "b"]) == [
        "flows.b -> tasks.a: flows/b.py:1 imports tasks.a",
        "flows.pipeline -> flows.a: flows/pipeline.py:1 imports flows.a",
    ]
