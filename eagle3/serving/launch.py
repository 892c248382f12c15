"""The managed vLLM server's command line, its addresses, and how its exits and log lines read."""

from __future__ import annotations

import logging
import re
import signal
import socket
from collections.abc import Sequence

# Flags whose values ManagedServer decides; a second copy in extra_args is a conflict.
MANAGED_FLAGS = ("--model", "--host", "--port", "--served-model-name", "--api-key")
_LEVEL_RE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now (another process may still take it
    before the server binds; the server then exits and start() reports it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def url_host(host: str) -> str:
    """The host to *connect* to: a wildcard bind address is reached through loopback."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _flag_name(arg: str) -> str:
    # vLLM's parser takes --served_model_name as --served-model-name: compare one spelling.
    return arg.split("=", 1)[0].replace("_", "-")


def build_argv(
    command: Sequence[str],
    model: str,
    host: str,
    port: int,
    served_model_name: str | None,
    extra_args: Sequence[str],
) -> list[str]:
    """The full server command line (never contains the API key)."""
    clash = sorted({_flag_name(a) for a in extra_args} & set(MANAGED_FLAGS))
    if clash:
        raise ValueError(f"extra_args must not set {clash}: ManagedServer sets them itself")
    model_args = [model] if command and command[-1] == "serve" else ["--model", model]
    argv = [*command, *model_args, "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv + list(extra_args)


def line_level(line: str) -> int:
    """Forward vLLM's WARNING/ERROR lines at their own level so they stand out."""
    match = _LEVEL_RE.search(line[:80])
    level = logging.getLevelName(match.group(1)) if match else logging.INFO
    return max(level, logging.INFO)


def exit_description(code: int | None) -> str:
    """``killed by SIGKILL`` / ``exit code 3`` for a Popen returncode."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
