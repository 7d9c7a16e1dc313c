"""Fixtures of the integration tier: the demo app on the session's worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tasks import systems


@pytest.fixture
def saga(worker: Any, demo_app: Any) -> Iterator[Any]:
    """A fresh world (one order, one open ticket, no faults) for each test."""
    systems.reset()
    yield demo_app.saga
    systems.clear_switches()
