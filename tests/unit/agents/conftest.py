"""Fixtures of the agent tests: each format in turn, and a mock provider for it."""

from __future__ import annotations

import pytest

from saga.agents import ModelFormat
from tests.unit.agents.helpers import ModelServer, http_module, sdk, sdk_name


@pytest.fixture(params=list(ModelFormat), ids=lambda f: f.value)
def fmt(request: pytest.FixtureRequest) -> ModelFormat:
    """Each of the three formats in turn."""
    chosen: ModelFormat = request.param
    return chosen


@pytest.fixture
def server(fmt: ModelFormat) -> ModelServer:
    """A mock provider speaking ``fmt``, over the HTTP library its SDK uses."""
    return ModelServer(http_module(sdk(sdk_name(fmt))))
