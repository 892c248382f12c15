"""Running the fake server: in a thread or its own process from tests, or standalone from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from .config import FakeConfig
from .model import _pool
from .wire import serve


def _http(url_root: str, method: str, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    host, port = url_root.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_healthy(url: str, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"fake server exited with code {proc.returncode} before answering /health")
        try:
            if _http(url, "GET", "/health", timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"fake server at {url} not healthy after {timeout_s} s")
        time.sleep(0.02)


@dataclass
class FakeServer:
    """What `run_fake_server` yields."""

    config: FakeConfig
    port: int
    host: str = "127.0.0.1"
    pid: int | None = None  # the server process (subprocess mode)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stats(self, attempts: bool = True) -> dict:
        status, body = _http(self.url, "GET", "/stats" if attempts else "/stats?attempts=0")
        if status != 200:
            raise RuntimeError(f"GET /stats answered {status}")
        return json.loads(body)

    def reset_stats(self) -> None:
        status, _ = _http(self.url, "POST", "/stats/reset")
        if status != 200:
            raise RuntimeError(f"POST /stats/reset answered {status}")


@contextlib.contextmanager
def _in_thread(cfg: FakeConfig, host: str, port: int, startup_timeout_s: float) -> Iterator[FakeServer]:
    ready = threading.Event()
    box: dict[str, Any] = {}

    def main() -> None:
        async def run() -> None:
            box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
            await serve(cfg, host, port, box["stop"], on_ready=lambda p: (box.update(port=p), ready.set()))

        try:
            asyncio.run(run())
        except BaseException as exc:  # surfaced to the caller below
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=main, name="fake-openai", daemon=True)
    thread.start()
    if not ready.wait(startup_timeout_s) or "error" in box:
        raise RuntimeError(f"fake server thread failed to start: {box.get('error')!r}")
    server = FakeServer(cfg, box["port"], host)
    try:
        wait_healthy(server.url, startup_timeout_s)
        yield server
    finally:
        box["loop"].call_soon_threadsafe(lambda: box["stop"].done() or box["stop"].set_result(None))
        thread.join(10)


def _read_port(proc: subprocess.Popen, timeout_s: float) -> int:
    """The child prints `LISTENING <port>` once bound."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError(f"fake server subprocess did not report its port in {timeout_s} s")
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("LISTENING "):
        raise RuntimeError(f"fake server subprocess failed to start (exit {proc.poll()}): {line!r}")
    return int(line.split()[1])


def _stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL to its process group (its own session) after the grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet, so the group id is still ours
            proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


@contextlib.contextmanager
def _in_process(
    cfg: FakeConfig, host: str, port: int, startup_timeout_s: float, grace_s: float
) -> Iterator[FakeServer]:
    cmd = [
        sys.executable,
        os.path.dirname(os.path.abspath(__file__)),  # the package folder: runs its __main__.py
        "--config",
        cfg.to_json(),
        "--host",
        host,
        "--port",
        str(port),
        "--parent-pid",
        str(os.getpid()),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        server = FakeServer(cfg, _read_port(proc, startup_timeout_s), host, pid=proc.pid)
        wait_healthy(server.url, startup_timeout_s, proc)
        yield server
    finally:
        _stop_process(proc, grace_s)


@contextlib.contextmanager
def run_fake_server(
    config: FakeConfig | None = None,
    port: int = 0,
    *,
    in_thread: bool = True,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 20.0,
    grace_s: float = 5.0,
) -> Iterator[FakeServer]:
    """Start the fake server (port 0: a free one), wait for /health, yield it, stop it on exit.

    in_thread=True: a thread of this process (unit tests). in_thread=False: its own process, so a
    benchmark measures the client rather than a shared GIL.
    """
    cfg = config or FakeConfig()
    if in_thread:
        with _in_thread(cfg, host, port, startup_timeout_s) as server:
            yield server
    else:
        with _in_process(cfg, host, port, startup_timeout_s, grace_s) as server:
            yield server


# --------------------------------------------------------------------------- command line


def _watch_parent(parent_pid: int, stop: asyncio.Future) -> None:
    """Stop when the process that started us is gone, so a crashed test run leaves no server behind."""
    loop = asyncio.get_running_loop()

    def check() -> None:
        if os.getppid() != parent_pid and not stop.done():
            stop.set_result(None)
        elif not stop.done():
            loop.call_later(1.0, check)

    loop.call_later(1.0, check)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fault-injecting fake of a vLLM OpenAI chat server (tests only).")
    parser.add_argument("--config", default="{}", help="FakeConfig as JSON, or @FILE holding it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: pick a free port (printed)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    args = parser.parse_args(argv)
    text = open(args.config[1:]).read() if args.config.startswith("@") else args.config
    cfg = FakeConfig.from_json(text)
    _pool()  # build the token pool before announcing readiness

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
        if args.parent_pid is not None:
            _watch_parent(args.parent_pid, stop)
        await serve(cfg, args.host, args.port, stop, on_ready=lambda p: print(f"LISTENING {p}", flush=True))

    asyncio.run(run())
