"""Static checks of docker/ (no container engine runs here): every copied path exists, the compose
file parses and wires the services together, and each image's command exists in the project."""

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import ROOT

DOCKER = ROOT / "docker"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for word, rest in instructions(dockerfile):
        if word in ("COPY", "ADD"):
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def worker_script(worker: dict) -> str:
    """The shell line the compose worker runs (after scripts/secret-env.sh and `bash -c`)."""
    command = worker["command"]
    assert command[:3] == ["scripts/secret-env.sh", "bash", "-c"], command[:3]
    return command[3]


def test_every_path_the_images_copy_exists():
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        sources = copy_sources(dockerfile)
        assert sources, f"{dockerfile.name} copies nothing"
        for src in sources:
            assert (ROOT / src).exists(), (
                f"{dockerfile.name}: COPY {src} (relative to the build context, the project root) does not exist"
            )


def test_compose_parses_and_builds_from_files_that_exist():
    services = compose()["services"]
    assert {"postgres", "prefect-server", "worker", "vllm"} <= set(services)
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context must be the project root"
            assert (context / build["dockerfile"]).exists(), f"{name}: {build['dockerfile']} missing"
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert services["worker"]["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    gpu = services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert all(p.startswith("127.0.0.1:") for p in services["prefect-server"]["ports"]), "the UI is bound to loopback"


def test_the_commands_the_images_run_exist_in_the_project():
    requirements = (ROOT / "requirements" / "pipeline.txt").read_text()
    assert re.search(r"^prefect==", requirements, re.M), (
        "the worker image runs `prefect`: it must be a pinned requirement"
    )
    worker = dict(instructions(DOCKER / "worker.Dockerfile"))
    assert worker["CMD"].startswith('["prefect", "worker", "start", "--pool", "eagle3-process"')
    deployments = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]
    assert {d["work_pool"]["name"] for d in deployments} == {"eagle3-process"}
    vllm = dict(instructions(DOCKER / "vllm.Dockerfile"))
    assert "vllm.entrypoints.openai.api_server" in vllm["ENTRYPOINT"]
    for src in copy_sources(DOCKER / "vllm.Dockerfile"):
        assert src.startswith("eagle3/extract/vllm_") or src == "scripts/secret-env.sh", src


def test_deployment_entrypoints_exist():
    import importlib

    for d in yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]:
        path, func = d["entrypoint"].split(":")
        assert (ROOT / path).exists(), d["entrypoint"]
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, func)), d["entrypoint"]
    nightly = next(
        d
        for d in yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]
        if d["name"] == "nightly-regeneration"
    )
    assert nightly["schedules"][0]["cron"] == "0 2 * * *" and nightly["schedules"][0]["timezone"]


def test_compose_runs_a_ray_head_and_a_gpu_worker_from_the_project_image():
    services = compose()["services"]
    head, worker, prefect_worker = services["ray-head"], services["ray-worker"], services["worker"]
    for name in ("ray-head", "ray-worker"):
        assert services[name]["build"] == services["worker"]["build"], (
            f"{name}: the project image (same Ray, same code)"
        )
        assert services[name]["command"][:2] == ["ray", "start"] and "--block" in services[name]["command"], name
    assert "--head" in head["command"] and "--port=6379" in head["command"] and "--num-gpus=0" in head["command"]
    assert "--address=ray-head:6379" in worker["command"]
    gpu = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert all(p.startswith("127.0.0.1:") for p in head["ports"]), "the Ray dashboard is bound to loopback"
    # The Prefect worker's flow runs drive the cluster: it joins as a node that offers nothing.
    assert "ray start --address=ray-head:6379 --num-cpus=0 --num-gpus=0 && " in worker_script(prefect_worker)
    assert prefect_worker["environment"]["EAGLE3_RAY_HEAD"] == "ray-head:6379"
    for name in ("ray-head", "ray-worker", "worker"):
        assert "runs:/opt/eagle3/runs" in services[name]["volumes"], f"{name}: the run folder at the same path"
        assert services[name]["shm_size"], f"{name}: Ray's object store needs /dev/shm"


def test_the_ray_commands_exist_in_the_images_environment():
    """The image installs requirements/pipeline.txt; this environment installs the same pins. `ray`
    must be a console script of the pinned version, and every `ray start` flag that compose, the
    Kubernetes worker and KubeRay's rayStartParams pass must be one Ray 2.x accepts."""
    import json
    import subprocess
    import sys
    from importlib.metadata import distribution

    pinned = re.search(r"^ray\[default\]==(\S+)", (ROOT / "requirements" / "pipeline.txt").read_text(), re.M)
    assert pinned, "the images run `ray start`: ray[default] (with the dashboard) must be pinned"
    ray = distribution("ray")
    assert ray.version == pinned.group(1)
    assert any(ep.name == "ray" and ep.group == "console_scripts" for ep in ray.entry_points)
    # In a child process: this test process must not import ray (tests/unit/test_cluster_config.py checks that).
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from ray.scripts.scripts import start; "
            "print(json.dumps(sorted(o for p in start.params for o in p.opts)))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    accepted = set(json.loads(out.stdout.strip().splitlines()[-1]))
    used = set()
    services = compose()["services"]
    for name in ("ray-head", "ray-worker"):
        used |= {arg.split("=")[0] for arg in services[name]["command"][2:]}
    used |= {f.split("=")[0] for f in re.findall(r"--[a-z-]+=?", worker_script(services["worker"]).split("&&")[0])}
    for doc in yaml.safe_load_all((ROOT / "deployments" / "k8s" / "raycluster.yaml").read_text()):
        groups = [doc["spec"]["headGroupSpec"]] + doc["spec"]["workerGroupSpecs"]
        used |= {f"--{key}" for group in groups for key in group.get("rayStartParams", {})}
    k8s_worker = next(
        doc
        for doc in yaml.safe_load_all((ROOT / "deployments" / "k8s" / "prefect-worker.yaml").read_text())
        if doc["kind"] == "Deployment"
    )
    script = k8s_worker["spec"]["template"]["spec"]["containers"][0]["args"][0]
    ray_line = next(line for line in script.splitlines() if line.strip().startswith("ray start"))
    used |= {f.split("=")[0] for f in re.findall(r"--[a-z-]+=?", ray_line)}
    assert used - accepted == set(), f"`ray start` does not accept {sorted(used - accepted)}"
    assert {"--head", "--address", "--block", "--num-gpus", "--dashboard-host"} <= used


# Prefect's basic-auth settings: the server's credential and the one a client presents.
AUTH_SETTINGS = ("PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING")


def test_the_compose_prefect_server_requires_a_credential_read_from_a_secret():
    """The server and the worker get the credential from the compose secret's file (scripts/secret-env.sh
    turns NAME_FILE into NAME), never as a value in the file: no auth setting is set in any service's
    environment or command, and the secret comes from a file outside the repository's tracked files."""
    doc = compose()
    services = doc["services"]
    secret = "prefect-auth-string"
    source = doc["secrets"][secret]
    assert set(source) == {"file"}, f"the secret {secret} must come from a file: {source}"
    assert source["file"].endswith("./secrets/prefect-auth-string}")
    assert "docker/secrets/" in (ROOT / ".gitignore").read_text().splitlines(), "the secret's folder is ignored"
    wants = {"prefect-server": "PREFECT_SERVER_API_AUTH_STRING", "worker": "PREFECT_API_AUTH_STRING"}
    for name, setting in wants.items():
        service = services[name]
        assert secret in service["secrets"], name
        assert service["environment"][f"{setting}_FILE"] == f"/run/secrets/{secret}", name
        assert service["command"][0] == "scripts/secret-env.sh", f"{name}: the command loads the secret first"
    for name, service in services.items():
        env = service.get("environment") or {}
        for setting in AUTH_SETTINGS:
            assert setting not in env, f"{name}: {setting} is set in the compose file; name its file (_FILE) instead"
            assert setting + "=" not in " ".join(map(str, service.get("command") or [])), name
    script = ROOT / "scripts" / "secret-env.sh"
    assert os.access(script, os.X_OK), "scripts/secret-env.sh must be executable (compose runs it as the command)"
    assert all(f"load {setting}" in script.read_text() for setting in AUTH_SETTINGS)
    copied = {
        src for word, rest in instructions(DOCKER / "worker.Dockerfile") if word == "COPY" for src in rest.split()
    }
    assert "scripts" in copied, "the worker image (the server's too) must carry scripts/secret-env.sh"


def test_secret_env_loads_a_file_and_refuses_a_missing_one(tmp_path):
    import subprocess

    script = str(ROOT / "scripts" / "secret-env.sh")
    env = {"PATH": os.environ["PATH"]}
    show = ""
    for name in LOADED:
        secret = tmp_path / name
        secret.write_text(f"{name}:pa ss\n")
        env[f"{name}_FILE"] = str(secret)
        show += f'printf "%s|%s;" "${name}" "${{{name}_FILE-unset}}"; '
    out = subprocess.run([script, "sh", "-c", show], env=env, capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "".join(f"{name}:pa ss|unset;" for name in LOADED)), out
    env["PREFECT_SERVER_API_AUTH_STRING_FILE"] = str(tmp_path / "missing")
    out = subprocess.run([script, "true"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and f"PREFECT_SERVER_API_AUTH_STRING_FILE={tmp_path / 'missing'}" in out.stderr, out


# What scripts/secret-env.sh turns from NAME_FILE into NAME: Prefect's two settings, vLLM's key on both sides and
# the Prefect server's database password.
LOADED = (*AUTH_SETTINGS, "VLLM_API_KEY", "EAGLE3_API_KEY", "PREFECT_SERVER_DATABASE_PASSWORD")
# A variable whose name says it holds a credential.
CREDENTIAL_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|AUTH_STRING|CONNECTION_URL)$")
# A connection URL may name its password only by Prefect's placeholder, escaped for compose ($$: left to Prefect,
# which puts PREFECT_SERVER_DATABASE_PASSWORD there).
PLACEHOLDER_URL = re.compile(r"^[a-z+]+://[^:/@]+:\$\$\{PREFECT_SERVER_DATABASE_PASSWORD\}@[^@]+$")


def compose_credential_problems(doc: dict) -> list[str]:
    """Where docker/compose.yaml writes a credential, or passes one on a command line: a service
    environment variable named like one (its _FILE form, a path under /run/secrets, is how it should come),
    a value taken from the host's environment under a credential's name, or a --api-key argument."""
    problems = []
    for name, service in doc["services"].items():
        env = service.get("environment") or {}
        for var, value in env.items():
            if var.endswith("CONNECTION_URL") and PLACEHOLDER_URL.match(str(value)):
                continue
            if CREDENTIAL_NAME.search(var):
                problems.append(f"{name}: {var} is set in the file; set {var}_FILE to its secret's path instead")
            elif var.endswith("_FILE") and not str(value).startswith("/run/secrets/"):
                problems.append(f"{name}: {var} is not a secret's path: {value}")
            for ref in re.findall(r"(?<!\$)\$\{([A-Za-z0-9_]+)", str(value)):
                if CREDENTIAL_NAME.search(ref):
                    problems.append(f"{name}: {var} takes the host's {ref}")
        words = []
        for arg in map(str, service.get("command") or []):  # a `bash -c` script's words too
            words += shlex.split(arg) if " " in arg else [arg]
        if any(w == "--api-key" or w.startswith("--api-key=") for w in words):
            problems.append(f"{name}: --api-key on the command line (`ps` shows it to every user)")
    return problems


def test_compose_writes_no_credential_and_vllms_key_comes_from_a_secret():
    """vLLM's key, like the Prefect credential, is a compose secret's file: the vllm image's entrypoint
    (scripts/secret-env.sh) sets VLLM_API_KEY from it, which vLLM reads, and the worker gets EAGLE3_API_KEY
    (server.api_key_env's default) the same way. No service has a credential in its environment or on its
    command line. The check bites on the ways the file used to do it."""
    from eagle3.config import ServerConfig

    doc = compose()
    services = doc["services"]
    assert compose_credential_problems(doc) == []
    assert doc["secrets"]["vllm-api-key"] == {"file": "${VLLM_KEY_FILE:-./secrets/vllm-api-key}"}
    vllm, worker = services["vllm"], services["worker"]
    assert vllm["secrets"] == ["vllm-api-key"] and vllm["environment"] == {
        "VLLM_API_KEY_FILE": "/run/secrets/vllm-api-key"
    }
    image = instructions(DOCKER / "vllm.Dockerfile")
    entrypoint = json.loads(dict(image)["ENTRYPOINT"])
    copied = [shlex.split(rest) for word, rest in image if word == "COPY" and "scripts/secret-env.sh" in rest]
    assert copied and copied[0][-1] == entrypoint[0], "the entrypoint is the copy of scripts/secret-env.sh"
    assert "--chmod=755" in copied[0], "the script runs as the entrypoint: it must be executable in the image"
    assert entrypoint[1:] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert "vllm-api-key" in worker["secrets"] and worker["environment"]["EAGLE3_API_KEY_FILE"] == (
        "/run/secrets/vllm-api-key"
    )
    assert ServerConfig().api_key_env == "EAGLE3_API_KEY", "the worker's flows read the key under the default name"
    script = (ROOT / "scripts" / "secret-env.sh").read_text()
    assert all(f"load {name}\n" in script for name in LOADED)

    before = copy.deepcopy(doc)
    before["services"]["vllm"]["command"] += ["--api-key", "${VLLM_API_KEY:?set VLLM_API_KEY}"]
    before["services"]["worker"]["environment"]["EAGLE3_API_KEY"] = "${VLLM_API_KEY:?set it}"
    before["services"]["worker"]["environment"]["HF_TOKEN_FILE"] = "/opt/eagle3/hf-token"
    assert compose_credential_problems(before) == [
        "worker: EAGLE3_API_KEY is set in the file; set EAGLE3_API_KEY_FILE to its secret's path instead",
        "worker: EAGLE3_API_KEY takes the host's VLLM_API_KEY",
        "worker: HF_TOKEN_FILE is not a secret's path: /opt/eagle3/hf-token",
        "vllm: --api-key on the command line (`ps` shows it to every user)",
    ]


def test_the_database_password_is_a_secret_prefect_puts_into_its_connection_url(tmp_path):
    """postgres reads its password from the compose secret's file; the Prefect server's connection URL holds
    Prefect's placeholder, and scripts/secret-env.sh sets the password it stands for from the same file. Run
    here as the server's container runs it: the URL Prefect resolves carries the file's password."""
    doc = compose()
    postgres, server = doc["services"]["postgres"], doc["services"]["prefect-server"]
    assert doc["secrets"]["postgres-password"] == {"file": "${POSTGRES_PASSWORD_FILE:-./secrets/postgres-password}"}
    assert postgres["secrets"] == ["postgres-password"] and "POSTGRES_PASSWORD" not in postgres["environment"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres-password"
    assert "postgres-password" in server["secrets"]
    assert server["environment"]["PREFECT_SERVER_DATABASE_PASSWORD_FILE"] == "/run/secrets/postgres-password"
    url = server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]

    secret = tmp_path / "postgres-password"
    secret.write_text("s3cr3t-Pw\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_SERVER_DATABASE_PASSWORD_FILE": str(secret),
        "PREFECT_API_DATABASE_CONNECTION_URL": url.replace("$$", "$"),  # as compose hands it over
    }
    probe = (
        "from prefect.settings import get_current_settings as s; "
        "print(s().server.database.connection_url.get_secret_value())"
    )
    out = subprocess.run(
        [str(ROOT / "scripts" / "secret-env.sh"), sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "postgresql+asyncpg://prefect:s3cr3t-Pw@postgres:5432/prefect", out.stdout

    before = copy.deepcopy(doc)  # the ways the file used to write it
    before["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] = "${POSTGRES_PASSWORD:-prefect}"
    before["services"]["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"] = (
        "postgresql+asyncpg://prefect:${POSTGRES_PASSWORD:-prefect}@postgres:5432/prefect"
    )
    assert compose_credential_problems(before) == [
        "postgres: POSTGRES_PASSWORD is set in the file; set POSTGRES_PASSWORD_FILE to its secret's path instead",
        "postgres: POSTGRES_PASSWORD takes the host's POSTGRES_PASSWORD",
        "prefect-server: PREFECT_API_DATABASE_CONNECTION_URL is set in the file; set "
        "PREFECT_API_DATABASE_CONNECTION_URL_FILE to its secret's path instead",
        "prefect-server: PREFECT_API_DATABASE_CONNECTION_URL takes the host's POSTGRES_PASSWORD",
    ]
