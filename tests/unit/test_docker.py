"""Static checks of docker/ (no container engine runs here): every copied path exists, the compose
file parses and wires the services together, and each image's command exists in the project."""

import re
import shlex
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
        assert src.startswith("eagle3/extract/vllm_")


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
