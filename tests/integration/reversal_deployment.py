"""A deployment whose unwinds ask a person: the worker runs ``tests.reliability.reversal_app``
(a credit over $1,000 asks before it is reversed), its notices go to a test receiver, and
the console and API over it (``create_app``) have two tokens: alice (``operate``) and bob
(``read``).

Its Redis is a database of the session's server (``SAGA_REDIS_URL``) of its own, flushed before
and after: the session's worker (the demo app, whose credit never asks) must not take its
tasks. The records are a SQLite file of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from fastapi import FastAPI
from fastapi.testclient import TestClient

from saga import Saga, Settings
from saga.client import Client
from saga.model import CompensationState
from saga.picture import CompensationRecord
from saga.runs import Run
from saga.testing import WorkerProcess
from saga.web import create_app, tokens
from saga.web.settings import WebSettings
from tests.conftest import (
    MACHINE_REDIS,
    READ_ENV_ONCE,
    ROOT,
    TEST_DB,
    forget_modules_read_env_once,
    redis_url_with_db,
    service_missing,
)
from tests.integration.helpers import CREDIT, ORDER, TICKET, wait_until
from tests.integration.notify_receiver import SECRET, Receiver

APP = "tests.reliability.reversal_app"
#: Shared with the engine harness, whose tests open and flush it one at a time.
REVERSAL_DB = int(os.environ.get("SAGA_TEST_REVERSAL_REDIS_DB", str(TEST_DB - 1)))
TIME_LIMIT = 5


@dataclass
class Asking:
    """One Redis database, one records file, one worker of the reversal app, a receiver."""

    env: dict[str, str]
    saga: Saga
    app: FastAPI
    operate_token: str
    read_token: str
    receiver: Receiver
    data: Path
    worker: WorkerProcess

    def asked(self, amount: int = CREDIT) -> tuple[Run, CompensationRecord]:
        """A run that set the ticket pending, credited ``amount`` (over the threshold: its
        reversal asks), solved the ticket and was aborted: its unwind restored the ticket and
        now waits at the credit's undo (step 2) for a person."""
        run = self.saga.start_run()
        run.call("set_ticket_status", ticket_id=TICKET, status="pending").result(timeout=20)
        run.call("issue_credit", order_id=ORDER, amount_cents=amount, memo="x").result(timeout=20)
        run.call("set_ticket_status", ticket_id=TICKET, status="solved").result(timeout=20)
        run.abort("the customer cancelled")
        wait_until(lambda: self.undo(run, 2).state is CompensationState.ASKED, 30, "the question")
        return run, self.undo(run, 2)

    def undo(self, run: Run, step: int) -> CompensationRecord:
        return next(c for c in self.saga.picture(run.run_id).compensations if c.step == step)

    def client(self) -> TestClient:
        """A test client of the app (https: the console's cookies are Secure)."""
        return TestClient(self.app, base_url="https://testserver")

    def console(self, token: str) -> TestClient:
        """A console session for ``token``, logged in through the form as a browser does."""
        client = self.client()
        form = client.get("/console/login").text
        csrf = re.search(r'name="csrf" value="([^"]+)"', form)
        assert csrf is not None, form[:500]
        answer = client.post(
            "/console/login",
            data={"csrf": csrf.group(1), "token": token},
            follow_redirects=False,
        )
        assert answer.status_code == 303, answer.text
        return client


@contextmanager
def asking_deployment(data: Path, extra_env: dict[str, str] | None = None) -> Iterator[Asking]:
    """Started with its environment set in this process too, everything put back after."""
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    url = redis_url_with_db(MACHINE_REDIS, REVERSAL_DB)
    store = redis.Redis.from_url(url, socket_timeout=2)
    try:
        store.flushdb()
    except redis.RedisError as exc:
        service_missing(f"no Redis at {MACHINE_REDIS} ({exc})")
    receiver = Receiver()
    env = {
        "SAGA_REDIS_URL": url,
        "SAGA_BROKER_URL": url,
        "SAGA_RESULT_BACKEND": url,
        "SAGA_DEMO_DATA": str(data),
        "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
        "SAGA_VISIBILITY_TIMEOUT": "8",
        "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
        "SAGA_NOTIFY_WEBHOOK_URL": receiver.url,
        "SAGA_NOTIFY_WEBHOOK_SECRET": SECRET,
        "SAGA_NOTIFY_TIMEOUT": "3",
        # Within the visibility timeout, as the start-up guard requires of every retry
        "SAGA_NOTIFY_BACKOFF": "0.2",
        "SAGA_NOTIFY_BACKOFF_MAX": "0.5",
        "SAGA_APP": f"{APP}:saga",
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }
    imported_before = {name for name in READ_ENV_ONCE if name in sys.modules}
    saga: Any = None
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            from tasks import systems
            from tests.reliability.reversal_app import tools

            saga = Saga(_celery(url), tools, Settings.from_env())
            systems.reset()
            worker = WorkerProcess(
                APP, env=env, concurrency=2, cwd=ROOT, logfile=data / "worker.log"
            )
            with worker:
                app = create_app(
                    client=Client(settings=saga.settings),
                    records=saga.records,
                    settings=WebSettings(app=env["SAGA_APP"]),
                    saga=saga,
                )
                operate, _ = tokens.create(saga.records, "alice", "operate")
                read, _ = tokens.create(saga.records, "bob", "read")
                yield Asking(env, saga, app, operate, read, receiver, data, worker)
    finally:
        receiver.close()
        if saga is not None:
            saga.store.client.close()
            saga.records.dispose()
        store.flushdb()
        store.close()
        from tasks import systems

        systems.dispose_engines()
        forget_modules_read_env_once(keep=imported_before)


def _celery(url: str) -> Celery:
    app = Celery("reversal-deployment")
    app.config_from_object("celeryconfig")
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options={"visibility_timeout": 8},
        task_time_limit=TIME_LIMIT,
        task_soft_time_limit=TIME_LIMIT - 1,
    )
    return app
