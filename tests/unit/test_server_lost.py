"""The message a lost managed server leaves names the stage that was using it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3.config import load_config
from eagle3.serving.target import STAGE_OF_FOLDER, ServerLost, Serving


@pytest.mark.parametrize("folder, stage", [("generations", "generate"), ("prompts", "prepare")])
def test_a_lost_server_names_the_stage_it_served(folder, stage):
    config = load_config(None, ["server.max_restarts=2"])
    dead = SimpleNamespace(lost=RuntimeError("exit code -9"), restarts=2)
    serving = Serving(target=None, server=dead, stage=STAGE_OF_FOLDER[folder])
    with pytest.raises(
        ServerLost, match=rf"^{stage}: the vLLM server kept exiting: server.max_restarts=2 .*exit code -9"
    ):
        serving.raise_if_lost(config)
    Serving(target=None, server=SimpleNamespace(lost=None, restarts=0)).raise_if_lost(config)  # alive: nothing raised
