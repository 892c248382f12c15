"""Human-readable accounting read back from a run directory (``eagle3 status``)."""

from __future__ import annotations

from pathlib import Path

from eagle3 import stages
from eagle3.errors import MissingInputError
from eagle3.layout import RunLayout
from eagle3.manifest import read_manifest

COLUMNS = ("stage", "status", "in", "ok", "failed", "filtered", "reasons")


def _reasons(entry: dict) -> str:
    reasons = entry.get("reasons") or {}
    return ", ".join(f"{k}={n}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])) or "-"


def stage_results(run_dir: str | Path) -> dict:
    """{manifest entry: its typed result (eagle3.results)}, read back from the run's manifest."""
    from eagle3.results import result_class

    entries = read_manifest(run_dir).get("stages", {})
    return {name: result_class(name).from_entry(entry) for name, entry in entries.items()}


def status_rows(run_dir: str | Path) -> list[dict]:
    path = RunLayout.of(run_dir).manifest
    if not path.exists():
        problem = "does not exist: not a run directory, or no stage has finished yet"
        raise MissingInputError("status", path, "run a stage first (eagle3 run), or name another folder", problem)
    entries = stage_results(run_dir)
    order = stages.manifest_order()
    return [
        {
            "stage": name,
            "status": e.status,
            "in": e.counts.in_,
            "ok": e.counts.ok,
            "failed": e.counts.failed,
            "filtered": e.counts.filtered,
            "reasons": _reasons(e),
        }
        for name, e in sorted(entries.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    ]


def status_table(run_dir: str | Path) -> str:
    rows = [{c: str(r[c]) for c in COLUMNS} for r in status_rows(run_dir)]
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in COLUMNS}
    fmt = lambda r: "  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip()  # noqa: E731
    lines = [f"run: {run_dir}", fmt({c: c for c in COLUMNS}), fmt({c: "-" * widths[c] for c in COLUMNS})]
    return "\n".join(lines + [fmt(r) for r in rows])


# -- the run report: one markdown page a person reads --------------------------------------------


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _live_table(run: Path) -> list[str]:
    """The live comparison table from RUN/evaluate/live.json, when it holds one."""
    import json

    from eagle3.evaluate.table import markdown_table

    path = RunLayout.of(run).live
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict) or not doc.get("cells"):
        return []
    return ["", "## Live comparison (vLLM): decode speed and acceptance per method", "", markdown_table(doc)]


def markdown_report(run_dir: str | Path, embed_png: bool = False) -> str:
    """Accounting per stage, errors by kind, token statistics, vocabulary coverage, training
    curves, acceptance and where every output is -- read from the run directory alone."""
    run = Path(run_dir)
    entries = stage_results(run)
    lines = [
        f"# eagle3 run report: `{run.resolve()}`",
        "",
        "## Accounting",
        "",
        "| stage | status | in | ok | failed | filtered | reasons (by kind) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in status_rows(run):
        lines.append(
            f"| {r['stage']} | {r['status']} | {r['in']} | {r['ok']} | {r['failed']} | {r['filtered']} | "
            f"{r['reasons']} |"
        )
    errors = [f"- **{name}**: {e['error']}" for name, e in entries.items() if e.get("error")]
    if errors:
        lines += ["", "Errors:", *errors]
    tok = entries.get("tokenize")
    if tok:
        rate = (tok.get("template_check") or {}).get("mismatch_rate") or {}
        lines += [
            "",
            "## Tokens",
            "",
            (
                f"- {tok['tokens']} tokens in {tok['ok']} samples ({tok['tokens'] // max(tok['ok'], 1)} per sample), "
                f"{tok['supervised_tokens']} supervised "
                f"({100 * tok['supervised_tokens'] / max(tok['tokens'], 1):.1f}%), {tok['truncated_rows']} rows "
                "truncated"
            ),
            (
                f"- chat template vs server ids: prompt mismatch rate {_fmt(rate.get('prompt_mismatch'))}, full "
                f"mismatch rate {_fmt(rate.get('full_mismatch'))}"
            ),
        ]
    voc = entries.get("vocab")
    if voc is not None:
        lines += [
            (
                f"- draft vocabulary: {voc.draft_vocab_size} of {voc.target_vocab_size} target "
                f"ids{' (identity)' if voc.identity else ''}, coverage of supervised tokens "
                f"{100 * voc.coverage:.2f}%"
            )
        ]
    ext = entries.get("extract")
    if ext is not None:
        lines += [
            (
                f"- hidden states: layers {list(ext.layer_ids)} ({ext.mode}, {ext.backend} backend), "
                f"{ext.tokens} tokens, {ext.bytes / 2**20:.1f} MiB"
            )
        ]
    train = entries.get("train")
    if train:
        best = train.get("best") or {}
        lines += [
            "",
            "## Training",
            "",
            (
                f"- {train['ok']} optimizer steps, {train['tokens']} tokens in {train['seconds']} s on "
                f"{train['world_size']} process(es)"
            ),
            (
                f"- best checkpoint by held-out expected acceptance length: step {best.get('step')} "
                f"({_fmt(best.get('acceptance_length'))})"
            ),
        ]
        png = RunLayout.of(run).train_curves
        if png.exists():
            if embed_png:
                import base64

                lines += [
                    "",
                    f"![training curves](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})",
                ]
            else:
                lines += ["", "![training curves](train/curves.png)"]
    ev = entries.get("evaluate")
    if ev:
        lines += [
            "",
            "## Acceptance (live, vLLM spec-decode counters)",
            "",
            "| temperature | mean acceptance length | acceptance rate | untrained drafter |",
            "|---|---|---|---|",
        ]
        untrained = ev.get("untrained_mean_acceptance_length") or {}
        for t, length in (ev.get("mean_acceptance_length") or {}).items():
            lines.append(
                f"| {t} | {_fmt(length)} | {_fmt((ev.get('acceptance_rate') or {}).get(t))} | "
                f"{_fmt(untrained.get(t))} |"
            )
        lines += [
            "",
            f"Offline estimate from training (held-out, greedy chain): {_fmt(ev.get('offline_acceptance_length'))}",
        ]
        lines += _live_table(run)
    lines += ["", "## Where everything is", ""]
    for stage in stages.STAGES:
        if (run / stage.output).exists():
            lines.append(f"- `{run / stage.output}` -- {stage.outputs_doc}")
    lines.append(
        f"- `{RunLayout.of(run).manifest}` -- the accounting above, per stage, with config hashes and versions"
    )
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path) -> Path:
    from eagle3.durable import atomic_write_bytes

    path = RunLayout.of(run_dir).report
    atomic_write_bytes(path, markdown_report(run_dir).encode())
    return path
