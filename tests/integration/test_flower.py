"""Flower as saga starts it (``python -m saga.integrations.flower``), a real process on the
test's Redis: nothing without credentials, everything to read with them, no control at all."""

from __future__ import annotations

import base64
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from saga.integrations.flower import BASIC_AUTH_ENV, INSECURE_LOCAL_ENV, REFUSED
from saga.testing import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)

USER, PASSWORD = "ops", "correct-horse-battery"
AUTH = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

#: Flower's control routes: revoke/terminate, run or send any task, abort, change time
#: and rate limits, and every worker pool and queue action.
CONTROL = [
    "/api/task/revoke/run-1:1",
    "/api/task/async-apply/tools.issue_credit",
    "/api/task/apply/tools.issue_credit",
    "/api/task/send-task/tools.issue_credit",
    "/api/task/abort/run-1:1",
    "/api/task/timeout/tools.issue_credit",
    "/api/task/rate-limit/tools.issue_credit",
    "/api/worker/shutdown/celery@host",
    "/api/worker/pool/restart/celery@host",
    "/api/worker/pool/grow/celery@host",
    "/api/worker/pool/shrink/celery@host",
    "/api/worker/pool/autoscale/celery@host",
    "/api/worker/queue/add-consumer/celery@host",
    "/api/worker/queue/cancel-consumer/celery@host",
]


def status(url: str, *, auth: bool, post: bool = False) -> int:
    request = urllib.request.Request(url, data=b"{}" if post else None)
    if auth:
        request.add_header("Authorization", AUTH)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)


@pytest.fixture(scope="module")
def flower(saga_env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    env = {**saga_env, BASIC_AUTH_ENV: f"{USER}:{PASSWORD}", "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [sys.executable, "-m", "saga.integrations.flower", "-A", "tasks.app", f"--port={port}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if status(f"{base}/healthcheck", auth=False) == 200:
                    break
            except OSError:
                pass
            assert process.poll() is None, "Flower exited"
            assert time.monotonic() < deadline, "Flower did not answer in 60 s"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_nothing_is_shown_without_credentials(flower: str) -> None:
    for path in ("/", "/tasks", "/api/tasks", "/metrics", CONTROL[0]):
        assert status(flower + path, auth=False, post=path == CONTROL[0]) == 401, path


def test_the_pages_and_the_read_only_api_answer_with_credentials(flower: str) -> None:
    for path in ("/", "/tasks", "/api/tasks", "/api/task/types", "/metrics"):
        assert status(flower + path, auth=True) == 200, path


@pytest.mark.parametrize("path", CONTROL)
def test_every_control_action_is_refused_even_with_credentials(flower: str, path: str) -> None:
    assert status(flower + path, auth=True, post=True) == 403


def test_it_refuses_to_start_without_credentials(saga_env: dict[str, str]) -> None:
    env = {k: v for k, v in saga_env.items() if k not in (BASIC_AUTH_ENV, INSECURE_LOCAL_ENV)}
    done = subprocess.run(
        [sys.executable, "-m", "saga.integrations.flower", "-A", "tasks.app"],
        cwd=ROOT,
        env={**env, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == REFUSED
    assert BASIC_AUTH_ENV in done.stderr
