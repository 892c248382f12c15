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
