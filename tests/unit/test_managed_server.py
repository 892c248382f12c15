"""ManagedServer against small stand-in servers (standard library only, written into tmp_path).

The stand-in is a test tool for fault injection (crash, hang, ignored SIGTERM, leaked
key); the real vLLM is exercised in tests/integration/test_vllm_server.py. It reads the
flags ManagedServer passes (--model/--port/--served-model-name), so the command line is
tested too, and it enforces the Bearer key from VLLM_API_KEY the way vLLM does.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from eagle3.serving.managed import ManagedServer, ServerError, build_argv, free_port

STAND_IN = textwrap.dedent(
    """
    import argparse, http.server, json, os, signal, subprocess, sys, time

    p = argparse.ArgumentParser()
    p.add_argument("--model"); p.add_argument("--host"); p.add_argument("--port", type=int)
    p.add_argument("--served-model-name"); p.add_argument("--behave", default="ok")
    p.add_argument("--delay", type=float, default=1.0); p.add_argument("--unhealthy-flag")
    p.add_argument("--crash-if-exists")
    a, _ = p.parse_known_args()
    key = os.environ.get("VLLM_API_KEY")

    if a.crash_if_exists and os.path.exists(a.crash_if_exists):
        print("fatal: the crash flag is set", file=sys.stderr)
        sys.exit(4)

    if a.behave == "crash":
        print("fatal: cannot load model weights", file=sys.stderr)
        sys.exit(3)
    if a.behave == "hang":
        print("loading forever", flush=True)
        time.sleep(3600)
    if a.behave == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.behave == "leak-key":
        print(f"api key is {key} (oops)", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"GRANDCHILD {child.pid}", flush=True)
    time.sleep(a.delay)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                bad = a.unhealthy_flag and os.path.exists(a.unhealthy_flag)
                return self._send(503 if bad else 200, {})
            if self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, {"error": "Unauthorized"})
            if self.path == "/v1/models":
                return self._send(200, {"data": [{"id": a.served_model_name or a.model}]})
            self._send(404, {})

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    print("serving", flush=True)
    http.server.HTTPServer((a.host, a.port), H).serve_forever()
    """
)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "stand_in_server.py"
    path.write_text(STAND_IN)
    return path


@pytest.fixture()
def make(script: Path, tmp_path: Path):
    def make(behave: str = "ok", *more: str, **kwargs) -> ManagedServer:
        kwargs.setdefault("startup_timeout_s", 20)
        kwargs.setdefault("stop_grace_s", 5)
        return ManagedServer(
            [sys.executable, str(script)],
            "tiny-model",
            log_path=tmp_path / "server.log",
            extra_args=["--behave", behave, *more],
            **kwargs,
        )

    return make


def alive(pid: int) -> bool:
    """Running; a zombie counts as gone (PID 1 here reaps orphans only every ~2 s)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def grandchild_pid(log_path: Path) -> int:
    lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("GRANDCHILD ")]
    return int(lines[-1].split()[1])


def test_start_serves_and_stop_leaves_no_process(make, tmp_path):
    server = make("ok", served_model_name="tiny")
    began = time.monotonic()
    with server:
        assert time.monotonic() - began >= 1.0  # the stand-in's startup delay was waited for
        headers = {"Authorization": f"Bearer {server.api_key}"}
        models = httpx.get(f"{server.base_url}/models", headers=headers, timeout=5)
        assert models.json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{server.base_url}/models", timeout=5).status_code == 401
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        server.check()
        assert server.healthy
        leader, grandchild = server.pid, grandchild_pid(tmp_path / "server.log")
        assert alive(leader) and alive(grandchild)
    assert not alive(leader) and not alive(grandchild)
    server.stop()  # idempotent


def test_crash_during_startup_fails_fast_with_exit_code_and_log(make):
    began = time.monotonic()
    with pytest.raises(ServerError) as err:
        make("crash", startup_timeout_s=60).start()
    assert time.monotonic() - began < 10
    assert "exit code 3" in str(err.value)
    assert "fatal: cannot load model weights" in str(err.value)


def test_never_ready_times_out_and_kills_the_group(make, tmp_path):
    server = make("hang", startup_timeout_s=2)
    began = time.monotonic()
    with pytest.raises(ServerError, match=r"startup_timeout_s=2 s") as err:
        server.start()
    assert 2 <= time.monotonic() - began < 10
    assert "loading forever" in str(err.value)
    assert not alive(server.pid)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(make, tmp_path):
    server = make("ignore-term", stop_grace_s=1).start()
    grandchild = grandchild_pid(tmp_path / "server.log")
    began = time.monotonic()
    server.stop()
    assert 1 <= time.monotonic() - began < 10
    assert server._proc.returncode == -signal.SIGKILL
    assert not alive(server.pid) and not alive(grandchild)


def test_api_key_is_neither_logged_nor_on_the_command_line(make, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with make("leak-key") as server:
        key = server.api_key
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().decode()
        assert f"VLLM_API_KEY={key}" in environ  # the route vLLM reads it by
        assert key not in repr(server)
    log_text = (tmp_path / "server.log").read_text()
    assert "api key is *** (oops)" in log_text
    assert key not in log_text
    assert key not in caplog.text
    assert f"[vllm:{server.port}] api key is *** (oops)" in caplog.text  # and reach the logger


def test_keyboard_interrupt_inside_with_still_stops(make, tmp_path):
    server = make("ok")
    with pytest.raises(KeyboardInterrupt):
        with server:
            grandchild = grandchild_pid(tmp_path / "server.log")
            raise KeyboardInterrupt
    assert not alive(server.pid) and not alive(grandchild)


def test_check_raises_after_external_kill(make):
    with make("ok") as server:
        os.kill(server.pid, signal.SIGKILL)
        server._proc.wait(5)
        with pytest.raises(ServerError, match="exited while running .killed by SIGKILL"):
            server.check()
    with pytest.raises(ServerError, match="not running"):
        server.check()


def test_interpreter_exit_without_stop_still_stops_the_server(script, tmp_path):
    log = tmp_path / "server.log"
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        import sys
        from eagle3.serving import ManagedServer
        server = ManagedServer([sys.executable, {str(script)!r}], "m", log_path={str(log)!r},
                               extra_args=["--delay", "0"], startup_timeout_s=20, stop_grace_s=5)
        server.start()
        print(server.pid, flush=True)
        # no stop(), no with: only the atexit hook can clean up
    """)
    )
    done = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    leader, grandchild = int(done.stdout.split()[0]), grandchild_pid(log)
    assert not alive(leader) and not alive(grandchild)


def test_health_watcher_records_failures_without_killing(make, tmp_path):
    flag = tmp_path / "unhealthy"
    with make("ok", "--unhealthy-flag", str(flag), "--delay", "0", health_interval_s=0.1) as server:
        flag.touch()
        deadline = time.monotonic() + 5
        while server.consecutive_health_failures < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.healthy
        assert server.last_error == "/health returned 503"
        server.check()  # still running: the watcher reports, it does not act
        flag.unlink()
        while server.consecutive_health_failures and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        assert server.healthy


def test_argv_model_position_and_managed_flags():
    module = build_argv(
        ["py", "-m", "vllm.entrypoints.openai.api_server"], "/m", "127.0.0.1", 8000, "tiny", ["--max-num-seqs", "4"]
    )
    assert module == [
        "py",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "4",
    ]
    serve = build_argv(["vllm", "serve"], "org/model", "0.0.0.0", 8000, None, [])
    assert serve[:3] == ["vllm", "serve", "org/model"] and "--served-model-name" not in serve
    for clash in (["--port", "1"], ["--api-key=x"], ["--model", "y"], ["--served_model_name", "z"]):
        with pytest.raises(ValueError, match="must not set"):
            build_argv(["vllm", "serve"], "m", "h", 1, None, clash)


def test_constructor_rejects_conflicts_and_picks_a_port(tmp_path):
    with pytest.raises(ValueError, match="VLLM_API_KEY"):
        ManagedServer(["vllm", "serve"], "m", log_path=tmp_path / "l", env={"VLLM_API_KEY": "x"})
    server = ManagedServer(["vllm", "serve"], "m", log_path=tmp_path / "l", host="0.0.0.0")
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"  # wildcard bind, loopback URL
    assert server.root_url == f"http://127.0.0.1:{server.port}"
    assert 0 < free_port() < 65536


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def serves_with_key(server: ManagedServer) -> bool:
    try:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        return httpx.get(f"{server.base_url}/models", headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_supervisor_restarts_on_the_same_port_and_key_then_gives_up(make, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with make("ok", "--delay", "0.2") as server:
        server.supervise(max_restarts=2, interval_s=0.1)
        port, key = server.port, server.api_key
        for n in (1, 2):
            old_pid, old_grandchild = server.pid, grandchild_pid(tmp_path / "server.log")
            os.killpg(old_pid, signal.SIGKILL)
            wait_for(lambda: server.restarts == n and server.restart_events[-1]["restarted"], 20, f"restart {n}")
            assert server.pid != old_pid and serves_with_key(server)
            assert (server.port, server.api_key) == (port, key), "clients keep their URL and key"
            assert not alive(old_pid) and not alive(old_grandchild)
            assert server.lost is None
        assert [e["exit"] for e in server.restart_events] == ["killed by SIGKILL"] * 2
        assert all(e["restarted"] for e in server.restart_events)
        assert "exited while running (killed by SIGKILL): restart 2 of 2" in caplog.text
        os.killpg(server.pid, signal.SIGKILL)  # a third death: no restart left
        wait_for(lambda: server.lost is not None, 10, "the supervisor to give up")
        assert "max_restarts=2 restarts are used up" in str(server.lost)
        assert "serving" in str(server.lost), "the log tail is part of the error"
        assert server.restarts == 2 and not serves_with_key(server)
    assert not alive(server.pid)


def test_a_failed_restart_counts_against_the_limit(make, tmp_path):
    flag = tmp_path / "crash"
    with make("ok", "--delay", "0.2", "--crash-if-exists", str(flag)) as server:
        server.supervise(max_restarts=1, interval_s=0.1)
        flag.touch()  # from now on the server dies at startup
        os.killpg(server.pid, signal.SIGKILL)
        wait_for(lambda: server.lost is not None, 20, "the supervisor to give up")
        assert server.restarts == 1 and server.restart_events[0]["restarted"] is False
        assert "max_restarts=1" in str(server.lost) and "exit code 4" in str(server.lost)


def test_stop_during_supervision_is_not_a_restart(make):
    server = make("ok", "--delay", "0.2").start()
    server.supervise(max_restarts=3, interval_s=0.05)
    server.stop()
    time.sleep(0.3)
    assert server.restarts == 0 and server.lost is None and not alive(server.pid)
    with pytest.raises(ServerError, match="stopped"):
        server.restart()


def test_the_server_inherits_none_of_this_processs_credentials(make, monkeypatch):
    """The server gets its own key by VLLM_API_KEY and nothing of the Prefect server's credential, the
    external servers' key (server.api_key_env, here a custom name), a Hugging Face or OpenAI token."""
    inherited = {
        "PREFECT_API_AUTH_STRING": "admin:prefect-secret",
        "PREFECT_API_KEY": "pnu_cloud-secret",
        "HF_TOKEN": "hf_secret",
        "OPENAI_API_KEY": "sk-secret",
        "EAGLE3_API_KEY": "external-secret",
        "EAGLE3_MANAGED_SERVER_KEY": "other-managed-secret",
        "VLLM_API_KEY": "stray-secret",
        "MY_VLLM_KEY": "custom-named-secret",
    }
    for name, value in inherited.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("EAGLE3_HARMLESS", "kept")
    with make("ok", "--delay", "0", drop_env=("MY_VLLM_KEY",)) as server:
        raw = Path(f"/proc/{server.pid}/environ").read_bytes().decode()
        environ = dict(entry.split("=", 1) for entry in raw.split("\0") if entry)
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        assert serves_with_key(server)
    assert environ["VLLM_API_KEY"] == server.api_key and environ["EAGLE3_HARMLESS"] == "kept"
    leaked = {name for name, value in inherited.items() if value in raw or value in cmdline}
    assert leaked == set(), f"the server inherited {sorted(leaked)}"


def test_given_api_key_is_used_and_validated(make, tmp_path):
    with make("ok", "--delay", "0", api_key="shared-replica-key") as server:
        assert server.api_key == "shared-replica-key" and serves_with_key(server)
    for bad in ("", " padded "):
        with pytest.raises(ValueError, match="api_key"):
            ManagedServer(["vllm", "serve"], "m", log_path=tmp_path / "l", api_key=bad)
