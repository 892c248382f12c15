"""docker/compose.yaml's Prefect server requires its credential. No container engine runs here, so
the server starts the way the compose file starts it, without Docker: the service's own command
(scripts/secret-env.sh reading the secret's file, then `prefect server start`) and its own
environment, the secret being a file as compose mounts it. What differs from the container, and
only that: the secret's path (compose mounts it at /run/secrets/NAME), SQLite instead of the
PostgreSQL service, loopback and a free port instead of 0.0.0.0:4200, this project's interpreter
first on PATH. Then: 401 without the credential or with a wrong one, 200 with it, health probes open,
and the eagle3 command presenting it from PREFECT_API_AUTH_STRING_FILE (or saying what to set)."""

import base64
import os
import secrets
import subprocess

import httpx
import pytest
import yaml

from conftest import PYTHON, ROOT
from prefect_server import VENV, Server

pytestmark = pytest.mark.integration

# The eagle3 command's own steps (cli/main.py runs them before any flow run starts).
CLI_CHECK = "from cli import prefect_auth; prefect_auth.load_auth_file(); prefect_auth.check_api(); print('accepted')"


def basic(credential: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(credential.encode()).decode()}


def compose_server(tmp_path, credential: str) -> Server:
    service = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["prefect-server"]
    secret = "prefect-auth-string"
    assert secret in service["secrets"], service["secrets"]
    env = {k: str(v) for k, v in service["environment"].items()}
    assert env["PREFECT_SERVER_API_AUTH_STRING_FILE"] == f"/run/secrets/{secret}"
    secret_file = tmp_path / secret
    secret_file.write_text(credential + "\n")  # as `echo` or an editor leaves it
    env["PREFECT_SERVER_API_AUTH_STRING_FILE"] = str(secret_file)
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL")  # SQLite under the server's PREFECT_HOME ...
    env.pop("PREFECT_SERVER_DATABASE_PASSWORD_FILE")  # ... which has no password (test_docker.py resolves that one)
    env["PATH"] = f"{VENV}{os.pathsep}{os.environ['PATH']}"

    def command(port: int) -> list[str]:
        argv = list(service["command"])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv[argv.index("--port") + 1] = str(port)
        return argv

    return Server(tmp_path / "home", extra_env=env, command=command)


@pytest.mark.timeout(180)
def test_the_compose_prefect_server_requires_its_credential_and_the_cli_presents_it(tmp_path):
    credential = f"admin:{secrets.token_hex(16)}"
    server = compose_server(tmp_path, credential)
    try:
        api = server.api
        assert httpx.get(f"{api}/health", timeout=10).status_code == 200, "probes need no credential"
        runs = f"{api}/flow_runs/filter"
        assert httpx.post(runs, json={}, timeout=10).status_code == 401
        assert httpx.post(runs, json={}, headers=basic("admin:wrong"), timeout=10).status_code == 401
        assert httpx.post(runs, json={}, headers=basic(credential), timeout=10).status_code == 200

        # The eagle3 command: without a credential it says what to set; from a file, it is accepted; a wrong
        # one is refused. Three processes at once (each imports Prefect).
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
        base |= {"PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)}
        wrong = tmp_path / "wrong"
        wrong.write_text("admin:wrong\n")
        cases = {
            "none": base,
            "file": {**base, "PREFECT_API_AUTH_STRING_FILE": str(tmp_path / "prefect-auth-string")},
            "wrong": {**base, "PREFECT_API_AUTH_STRING_FILE": str(wrong)},
        }
        procs = {
            name: subprocess.Popen(
                [PYTHON, "-c", CLI_CHECK],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name, env in cases.items()
        }
        out = {name: p.communicate(timeout=120)[0] for name, p in procs.items()}
    finally:
        server.stop()
    assert procs["file"].returncode == 0 and out["file"].strip().endswith("accepted"), out["file"][-2000:]
    assert procs["none"].returncode != 0 and "requires a credential: set PREFECT_API_AUTH_STRING" in out["none"]
    assert procs["wrong"].returncode != 0 and "refused the credential presented" in out["wrong"]
    for text in [*out.values(), (tmp_path / "home" / "server.log").read_text()]:
        assert credential.split(":")[1] not in text, "the credential was printed"
