"""Prometheus metrics from a real prefork worker started with ``--metrics-port``: one port for
the worker, whichever child ran each task."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from saga import RunState
from saga.testing import free_port
from tasks import systems
from tests.conftest import ROOT
from tests.integration.deployment import Deployment, deployment
from tests.integration.helpers import demo_steps, wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, int]]:
    port = free_port()
    with deployment(tmp_path_factory.mktemp("metrics"), {}, ["--metrics-port", str(port)]) as made:
        yield made, port


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_worker_serves_the_counters_of_its_steps_unwinds_and_runs(
    private: tuple[Deployment, int],
) -> None:
    made, port = private
    saga = made.saga
    before = scrape(port)
    started = REGISTRY.get_sample_value("saga_runs_started_total") or 0.0

    # Given the mail service down: credit and ticket succeed, the mail fails, the run unwinds
    systems.reset()
    systems.set_down("mail")
    run = saga.start_run()
    demo_steps(run)
    assert run.wait(timeout=60).state is RunState.COMPENSATED

    # When the worker's port is scraped
    def moved() -> dict[Any, float] | None:
        now = scrape(port)
        ended = value(now, "saga_runs_ended_total", state="compensated")
        return now if ended > value(before, "saga_runs_ended_total", state="compensated") else None

    after = wait_until(moved, 30, "the run's end to be counted")

    # Then every counter moved, summed over the pool's processes
    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("saga_steps_total", tool="issue_credit", outcome="succeeded") == 1
    assert delta("saga_steps_total", tool="set_ticket_status", outcome="succeeded") == 1
    assert delta("saga_steps_total", tool="send_reply", outcome="retried") == 2
    assert delta("saga_steps_total", tool="send_reply", outcome="failed") == 1
    assert delta("saga_compensations_total", tool="reverse_credit", outcome="done") == 1
    assert delta("saga_compensations_total", tool="set_ticket_status", outcome="done") == 1
    assert delta("saga_runs_ended_total", state="compensated") == 1
    assert delta("saga_unwind_duration_seconds_count", state="compensated") == 1
    assert delta("saga_stack_depth_count") == 1
    assert delta("saga_stack_depth_sum") == 2  # the credit's undo and the ticket's
    assert ("saga_escalations_open", ()) in after
    # and the run was counted as started where it was started (this process)
    assert REGISTRY.get_sample_value("saga_runs_started_total") == started + 1


def _worker_refusing(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tasks.app worker ARGS``, expected to refuse before it serves anything."""
    command = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "-P", "solo", *args]
    return subprocess.run(
        command,
        env={**os.environ, "SAGA_DEMO_DATA": str(tmp_path), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_metrics_port_without_prometheus_client_refuses_to_start(tmp_path: Path) -> None:
    # Given prometheus-client cannot be imported (a stand-in that fails as a missing one does)
    shadow = tmp_path / "shadow" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'prometheus_client'\", "
        "name='prometheus_client')\n"
    )
    path = os.pathsep.join([str(shadow.parent), str(ROOT)])

    # When a worker is started with the port, by option or by variable
    by_option = _worker_refusing(tmp_path, "--metrics-port", "0", PYTHONPATH=path)
    by_variable = _worker_refusing(tmp_path, PYTHONPATH=path, SAGA_METRICS_PORT="0")

    # Then it refuses at once, naming the extra to install
    for done in (by_option, by_variable):
        assert done.returncode == 2, done.stdout + done.stderr[-2000:]
        assert "pip install 'saga-compensation[metrics]'" in done.stderr
        assert " ready." not in done.stdout + done.stderr


def test_metrics_port_already_taken_refuses_to_start(tmp_path: Path) -> None:
    # Given the port is held by something else
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        # When a worker is started on it
        done = _worker_refusing(tmp_path, "--metrics-port", str(port))

    # Then it does not start without its endpoint: it says why and exits non-zero
    assert done.returncode != 0, done.stdout + done.stderr[-2000:]
    assert f"refusing to start: --metrics-port {port}" in done.stderr
