"""Rewrite tests/durations.json from a pytest JUnit report: each test's seconds (setup, call and teardown).

    .venv/bin/python -m pytest -n 2 --dist loadgroup --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/test_durations.py /tmp/suite.xml

tests/conftest.py hands the suite's work to the xdist workers longest first by these times; they are a
schedule, not an assertion, so a stale file only makes `make test` a little slower. Tests under
MIN_S are left out (they count as 0 s), which keeps the file short.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_S = 1.0


def nodeid(classname: str, name: str) -> str:
    """tests.unit.test_x[.TestClass] + name -> tests/unit/test_x.py[::TestClass]::name."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    raise SystemExit(f"{classname}: no test file under {ROOT} matches this JUnit classname")


def main(report: str) -> None:
    times = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds = float(case.get("time", 0))
        if seconds >= MIN_S:
            times[nodeid(case.get("classname"), case.get("name"))] = round(seconds, 1)
    out = ROOT / "tests" / "durations.json"
    out.write_text(json.dumps(dict(sorted(times.items())), indent=1) + "\n")
    print(f"{out}: {len(times)} tests of {MIN_S:.0f} s or more, {sum(times.values()):.0f} s in all")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: scripts/test_durations.py JUNIT.xml")
    main(sys.argv[1])
