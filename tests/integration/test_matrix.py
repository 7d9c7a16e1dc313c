"""A representative part of the integration tier on the other brokers and stores, inside
``make test``: the demo's runs (happy path, an unwind from each position, the pivot's
refusals, escalations, compensation retries) on RabbitMQ, on a Sentinel store and on a Redis
Cluster store, where the store's own suite and the listing run too (every script and read path
on three masters). All of the tier on each: ``make test-matrix``.

Each leg is a pytest of its own in a subprocess (its session fixtures start the worker on
that broker and store), on a Redis database index of its own so it never flushes this
session's; ``test_session_axes`` in it proves the leg really ran where it says.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TEST_BROKER, TEST_DB, TEST_STORE

SUBSET = ["tests/integration/test_session_axes.py", "tests/integration/test_saga.py"]
#: The legs' Redis database index, in the session's block (``tests.conftest.DB_BLOCK``).
LEG_DB = str(TEST_DB - 3)
LEGS = {
    "amqp-broker": {"SAGA_TEST_BROKER": "amqp"},
    "sentinel-store": {"SAGA_TEST_STORE": "sentinel"},
    "cluster-store": {"SAGA_TEST_STORE": "cluster"},
}
#: What each leg runs besides ``SUBSET``.
MORE = {
    "cluster-store": ["tests/integration/test_stack.py", "tests/integration/test_listing.py"],
}


@pytest.mark.timeout(660)
@pytest.mark.parametrize("leg", list(LEGS))
def test_the_core_runs_pass_on(leg: str) -> None:
    if (TEST_BROKER, TEST_STORE) != ("redis", "redis"):
        pytest.skip("a matrix leg already: make test-matrix runs every test there")
    # (not an xdist worker itself: its database index is already this worker's)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env = {**inherited, **LEGS[leg], "SAGA_TEST_REDIS_DB": LEG_DB}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *SUBSET,
            *MORE.get(leg, []),
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1:] or [""]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in summary[0] and "skipped" not in summary[0], summary
