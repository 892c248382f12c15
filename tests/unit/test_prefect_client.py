"""The Prefect client's retry window (cli/prefect_client.py): the same values wherever a flow runs, read by
Prefect as meant, and a lost Prefect server as one line. The outage itself:
tests/integration/test_orchestrator_loss.py."""

import os
import re
import subprocess

import httpx
import pytest
import yaml

from cli import prefect_client
from cli.prefect_client import CLIENT_SETTINGS, lost_api, window_s
from conftest import PYTHON, ROOT


def _dockerfile_env() -> dict[str, str]:
    text = (ROOT / "docker" / "worker.Dockerfile").read_text()
    return dict(re.findall(r"^\s*(PREFECT_[A-Z_]+)=(\S+?)\s*\\?$", text, flags=re.M))


def _ui_script_env() -> dict[str, str]:
    text = (ROOT / "scripts" / "ui.sh").read_text()
    return dict(re.findall(r'^export (PREFECT_[A-Z_]+)="\$\{\1:-([^}]*)\}"$', text, flags=re.M))


def test_the_retry_window_is_the_same_wherever_flows_run():
    """The eagle3 command, the worker image (compose and Kubernetes), `make ui` and every deployment."""
    docker = _dockerfile_env()
    assert {k: docker.get(k) for k in CLIENT_SETTINGS} == CLIENT_SETTINGS
    assert _ui_script_env() == CLIENT_SETTINGS
    for spec in ("deployments/prefect.yaml", "deployments/k8s/prefect.yaml"):
        for d in yaml.safe_load((ROOT / spec).read_text())["deployments"]:
            assert d["work_pool"]["job_variables"]["env"] == CLIENT_SETTINGS, (spec, d["name"])


def test_prefect_reads_the_settings_as_meant():
    """Prefect ignores an environment variable it does not know: each name must be one of its settings, and
    the values must parse to what the docs say (6 retries, jitter 0.2, 500 retried, 60 s per request)."""
    code = (
        "from cli import prefect_client; prefect_client.apply()\n"
        "from prefect.settings import get_current_settings\n"
        "s = get_current_settings()\n"
        "print(s.client.max_retries, s.client.retry_jitter_factor, sorted(s.client.retry_extra_codes), "
        "s.api.request_timeout)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_SETTINGS}
    out = subprocess.run([PYTHON, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["6", "0.2", "[500]", "60.0"]


def test_settings_the_user_chose_win():
    env = {"PREFECT_CLIENT_MAX_RETRIES": "9"}
    saved = {k: os.environ.get(k) for k in CLIENT_SETTINGS}
    try:
        for k in CLIENT_SETTINGS:
            os.environ.pop(k, None)
        os.environ.update(env)
        prefect_client.apply()
        assert os.environ["PREFECT_CLIENT_MAX_RETRIES"] == "9"
        assert os.environ["PREFECT_CLIENT_RETRY_EXTRA_CODES"] == "500"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_window_is_prefects_backoff():
    """Waits of 2**k s for k = 1..6, each jittered by Prefect's own clamped Poisson draw."""
    from prefect.utilities.math import clamped_poisson_interval, lower_clamp_multiple

    low, high = window_s(6, 0.2)
    assert low == pytest.approx(126 * lower_clamp_multiple(1.2)) and high == pytest.approx(126 * 1.2)
    assert 100 < low < 126 < high
    draws = [sum(clamped_poisson_interval(2**k, 0.2) for k in range(1, 7)) for _ in range(2000)]
    assert low - 1e-9 <= min(draws) and max(draws) <= high + 1e-9
    assert window_s(0, 0.2) == (0.0, 0.0) and window_s(3, 0.0) == (14.0, 14.0)


def _error(url: str, status: int | None = None) -> Exception:
    request = httpx.Request("POST", url)
    if status is None:
        return httpx.ConnectError("All connection attempts failed", request=request)
    return httpx.HTTPStatusError("boom", request=request, response=httpx.Response(status, request=request))


def test_a_lost_prefect_api_is_named_in_one_line(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "6")
    line = lost_api(_error("http://127.0.0.1:4200/api/flow_runs/x/set_state"))
    assert line is not None and "\n" not in line
    assert "PREFECT_API_URL=http://127.0.0.1:4200/api" in line and "PREFECT_CLIENT_MAX_RETRIES=6" in line
    assert "(no answer: ConnectError; a refused call is retried for at least 103 s" in line
    assert "run the same command again" in line
    assert "(it answered 503;" in lost_api(_error("http://127.0.0.1:4200/api/artifacts", 503))
    try:  # as the flow engine raises it: the API's error as the cause of another
        raise RuntimeError("Flow run crashed") from _error("http://127.0.0.1:4200/api/logs")
    except RuntimeError as chained:
        assert lost_api(chained) is not None
    # Not the Prefect server: the target's server, a client error, no URL at all.
    assert lost_api(_error("http://127.0.0.1:8000/v1/chat/completions")) is None
    assert lost_api(_error("http://127.0.0.1:4200/api/flows/x", 404)) is None
    assert lost_api(httpx.ConnectError("no request")) is None
    monkeypatch.delenv("PREFECT_API_URL")
    assert lost_api(_error("http://127.0.0.1:4200/api/logs")) is None


def test_the_command_prints_the_line_and_exits_1(monkeypatch, capsys):
    from cli import main

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")

    def lost(args):
        raise RuntimeError("Flow run crashed") from _error("http://127.0.0.1:4200/api/flow_runs/x/set_state")

    monkeypatch.setattr(main, "cmd_status", lost)
    assert main.main(["status", "runs/x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("eagle3 status: error: lost the Prefect server at PREFECT_API_URL=") and "\n" not in err

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(main, "cmd_status", bug)
    with pytest.raises(KeyError):
        main.main(["status", "runs/x"])
