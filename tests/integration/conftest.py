"""Fixtures of the integration tier: the demo app on the session's worker, and a turn worker
for the hosted agents (``tests/integration/hosted_app.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from saga.testing import WorkerProcess
from tasks import systems
from tests.conftest import ROOT


@pytest.fixture
def saga(worker: Any, demo_app: Any) -> Iterator[Any]:
    """A fresh world (one order, one open ticket, no faults) for each test."""
    systems.reset()
    yield demo_app.saga
    systems.clear_switches()


@pytest.fixture(scope="module")
def turn_worker(saga_env: dict[str, str], worker: Any) -> Iterator[WorkerProcess]:
    """The turns' worker: threads, so a model call never holds a prefork slot."""
    process = WorkerProcess(
        "tests.integration.hosted_app",
        env=saga_env,
        pool="threads",
        concurrency=10,
        extra_args=["-Q", "saga.turns"],
        cwd=ROOT,
    )
    with process:
        yield process
