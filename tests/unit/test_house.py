"""House rules that hold for every module: none over 500 lines.

A module past that size holds several ideas; split it by topic (a package with one module per
group, re-exporting its public names) before it hurts.
"""

from pathlib import Path

from conftest import ROOT

MAX_LINES = 500
FOLDERS = ("eagle3", "flows", "tasks", "tests", "benchmarks", "scripts")


def line_counts(root: Path, folders=FOLDERS) -> dict[str, int]:
    """Lines of every .py module under ``folders`` of ``root``, by path relative to ``root``."""
    counts = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            counts[rel.as_posix()] = len(path.read_text(encoding="utf-8").splitlines())
    return counts


def oversized(counts: dict[str, int], allowed=frozenset()) -> list[str]:
    return [f"{path}: {n} lines" for path, n in sorted(counts.items()) if n > MAX_LINES and path not in allowed]


def test_no_module_is_over_the_limit():
    over = oversized(line_counts(ROOT))
    assert not over, f"modules over {MAX_LINES} lines; split them by topic:\n  " + "\n  ".join(over)


def test_the_check_names_a_long_module_and_only_it(tmp_path):
    (tmp_path / "eagle3" / "deep").mkdir(parents=True)
    (tmp_path / "eagle3" / "deep" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "eagle3" / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "eagle3" / "deep" / "notes.txt").write_text("x\n" * 2 * MAX_LINES)
    counts = line_counts(tmp_path, ("eagle3",))
    assert oversized(counts) == [f"eagle3/deep/long.py: {MAX_LINES + 1} lines"]
    assert oversized(counts, frozenset({"eagle3/deep/long.py"})) == []


def test_no_two_test_modules_share_a_basename():
    """pytest imports test modules by basename (rootdir-relative, no packages): a second file with the same
    name stops collection of the whole suite ("import file mismatch"), which only a clean run shows."""
    from collections import Counter

    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1]
