"""Check that every relative link in the documentation resolves.

Reads README.md, CONTRIBUTING.md, benchmarks/README.md and docs/*.md; for each relative link the
target file must exist and, for a link into a markdown file with a ``#fragment``, a heading of that
file must produce that anchor (GitHub's rule: lower case, punctuation dropped, spaces to hyphens).
Links inside fenced code blocks are ignored. Run from the repository root; exits 1 on a broken link.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")


def anchors(path: Path) -> set[str]:
    found = set()
    for line in path.read_text().splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def broken_links(files: list[Path]) -> tuple[int, list[str]]:
    checked, broken = 0, []
    for doc in files:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            checked += 1
            path, _, fragment = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc.resolve()
            if not dest.exists():
                broken.append(f"{doc}: {target}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{doc}: {target}: no heading gives #{fragment}")
    return checked, broken


def main() -> int:
    files = [Path(p) for p in DOCS] + sorted(Path("docs").glob("*.md"))
    checked, broken = broken_links(files)
    print("\n".join(broken + [f"{checked} relative links checked, {len(broken)} broken"]))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
