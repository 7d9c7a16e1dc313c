"""Undos and messages of an older deploy that the deployed code no longer accepts, found before
an unwind meets them: by ``saga doctor`` (which fails) and by the worker's start-up (which
warns). Real Redis, real kombu messages; the stack entries are pushed as an older worker did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from saga import Saga, Settings
from saga.constants import run_keys
from saga.stale_shapes import stale_shapes
from saga.testing import RedisServer, WorkerProcess
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)
SAGA = str(Path(sys.executable).with_name("saga"))
APP = "tests.integration.stale_app:saga"


@dataclass
class Deploy:
    saga: Saga
    env: dict[str, str]
    data: Path

    def run_with_stack(self, state: str, *entries: dict[str, Any]) -> str:
        """A run in ``state`` whose stack holds ``entries`` as an older worker pushed them."""
        run = self.saga.start_run()
        run_key, _, _, stack_key, _ = run_keys(run.run_id)
        client = self.saga.store.client
        for step, entry in enumerate(entries, 1):
            undo = {"step": step, "idempotency_key": f"{run.run_id}:{step}:undo", **entry}
            client.rpush(stack_key, json.dumps(undo))
        client.hset(run_key, "state", state)
        return run.run_id


@pytest.fixture
def deploy(tmp_path: Path, saga_env: dict[str, str]) -> Iterator[Deploy]:
    # Imported once the session's environment is set: the app it builds reads
    # saga.celery_defaults, which reads the environment once, when first imported, for every
    # app of this process (the demo app of the other tests too).
    from tests.integration.stale_app import tools

    with RedisServer(directory=tmp_path / "redis") as server:
        url = f"{server.url}/0"
        app = Celery("stale-shapes-test")
        app.config_from_object("celeryconfig")
        app.conf.update(broker_url=url, result_backend=url)
        saga = Saga(app, tools, Settings(redis_url=url))
        env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": url,
            "SAGA_RESULT_BACKEND": url,
            "SAGA_DATABASE_URL": f"sqlite:///{tmp_path / 'saga.db'}",
            "PYTHONPATH": str(ROOT),
        }
        yield Deploy(saga, env, tmp_path)
        saga.store.client.close()


def old_shapes(deploy: Deploy) -> dict[str, str]:
    """A live run whose undo lacks the reason the deployed undo now requires, another whose
    undo names a tool that is gone, a completed run with both (never unwound: not reported),
    a queued step of a removed tool, and a step a worker holds unacknowledged."""
    old_undo = {"tool": "reverse_credit", "args": {"credit_id": "cr-1"}, "description": "old"}
    gone = {"tool": "void_credit", "args": {"credit_id": "cr-2"}, "description": "gone"}
    runs = {
        "old_args": deploy.run_with_stack("running", old_undo),
        "gone_tool": deploy.run_with_stack("unwinding", gone),
        "completed": deploy.run_with_stack("completed", old_undo, gone),
    }
    app = deploy.saga.app
    bad_args = {"run_id": "r-unacked", "step": 4, "args": {"order_id": "4921", "amount_cents": 1}}
    app.send_task("tools.issue_credit", kwargs=bad_args)
    app.send_task("tools.void_credit", kwargs={"run_id": "r-queued", "step": 3, "args": {}})
    return runs


def test_stale_undos_and_messages_are_found_and_current_ones_are_not(deploy: Deploy) -> None:
    # Given the shapes of an older deploy, and a step of this one's shape
    runs = old_shapes(deploy)
    current = {"tool": "reverse_credit", "args": {"credit_id": "c", "reason": "r"}}
    deploy.run_with_stack("running", current)

    with deploy.saga.app.connection_for_read() as connection:
        # (a worker took the issue_credit message and has not acknowledged it)
        channel = connection.default_channel
        held = channel.basic_get("celery", no_ack=False)  # the oldest
        assert held is not None and held.headers["task"] == "tools.issue_credit"

        # When the deployment is scanned
        scan = stale_shapes(deploy.saga.core)
        channel.basic_reject(held.delivery_tag, requeue=True)

    # Then each stale shape is named, where it is and why, and nothing else
    found = [str(s) for s in scan.stale]
    assert len(found) == 4, found
    assert any(runs["old_args"] in f and "reason: Field required" in f for f in found), found
    assert any(runs["gone_tool"] in f and "'void_credit' is not registered" in f for f in found)
    assert any("queue 'celery'" in f and "run r-queued, step 3" in f for f in found), found
    assert any("not acknowledged" in f and "order_id: Input should be" in f for f in found)
    assert not any(runs["completed"] in f for f in found)
    assert (scan.runs, scan.not_scanned) == (4, [])


def test_a_scan_past_its_cap_says_what_it_left(deploy: Deploy) -> None:
    for _ in range(3):
        deploy.run_with_stack("running")
    deploy.saga.app.send_task("tools.void_credit", kwargs={"run_id": "r", "step": 1, "args": {}})
    deploy.saga.app.send_task("tools.void_credit", kwargs={"run_id": "r", "step": 2, "args": {}})

    scan = stale_shapes(deploy.saga.core, max_runs=2, max_messages=1)

    assert scan.runs == 2 and scan.messages == 1 and len(scan.stale) == 1
    assert scan.not_scanned == [
        "the stacks of 1 run(s) past the first 2",
        "1 message(s) of queue 'celery' past the first 1",
    ]


def test_a_starting_worker_warns_and_doctor_fails_on_stale_shapes(deploy: Deploy) -> None:
    old_shapes(deploy)

    # When a worker of this deploy starts (on another queue: the old messages stay put)
    worker = WorkerProcess(APP.partition(":")[0], env=deploy.env, cwd=ROOT, extra_args=["-Q", "x"])
    with worker:
        # Then it warns about each in its log, and starts
        log = worker.log()
        assert log.count("the deployed code does not accept") == 4, log[-3000:]

        # and doctor's stale-shapes check fails, naming them, and it exits 1
        done = subprocess.run(
            [SAGA, "--app", APP, "doctor", "--json"],
            env={**os.environ, **deploy.env},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    assert done.stdout, done.stderr
    check = next(c for c in json.loads(done.stdout)["checks"] if c["name"] == "stale shapes")
    assert check["status"] == "fail", check
    assert check["detail"].startswith("4 the deployed code refuses"), check
    assert done.returncode == 1, done.stderr
