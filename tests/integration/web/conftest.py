"""One private deployment for the web tests: its own redis-server, a PostgreSQL schema of its
own for the records, a tool worker (the demo app) and a turn worker (the hosted agents of
``tests/integration/hosted_app.py``), and the web app over them with two tokens (``operate``
named alice, ``read`` named bob). Built once for the package, torn down after it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from saga import RunState, Saga
from saga.client import Client
from saga.settings import Settings
from saga.testing import WorkerProcess, free_port
from saga.web import create_app, tokens
from saga.web.settings import WebSettings
from tasks import systems
from tests.conftest import ROOT, postgres_schema
from tests.integration.deployment import Deployment, deployment
from tests.integration.helpers import demo_steps, wait_until

#: Where the browser tests leave their screenshots (gitignored).
ARTEFACTS = Path(os.environ.get("SAGA_TEST_ARTEFACTS", ROOT / "test-artefacts"))


@dataclass
class Web:
    deployment: Deployment
    app: FastAPI
    operate_token: str
    read_token: str
    database_url: str

    @property
    def saga(self) -> Saga:
        return self.deployment.saga  # type: ignore[no-any-return]

    @property
    def env(self) -> dict[str, str]:
        return dict(self.deployment.env)

    def console(self, token: str) -> TestClient:
        """A test client logged into the console with ``token``, as a browser does it: the
        login form (its cookie and CSRF value), then the form posted back."""
        client = self.client()
        answer = client.post(
            "/console/login",
            data={"csrf": login_value(client.get("/console/login").text), "token": token},
            follow_redirects=False,
        )
        assert answer.status_code == 303 and "saga_session" in client.cookies, answer.text
        return client

    def client(self, token: str | None = None) -> TestClient:
        """A test client of the app, as a holder of ``token`` (https: the cookies are Secure)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return TestClient(self.app, base_url="https://testserver", headers=headers)

    def escalated_run(self) -> str:
        """A credit issued and the ticket set, the run aborted, the credit's reversal failing
        for good (the billing service down): escalated, "compensation failed"."""
        systems.clear_switches()
        systems.reset()
        run = self.saga.start_run()
        demo_steps(run, upto=3)
        systems.set_down("reversal")
        run.abort("the customer cancelled")
        self.recorded(run.run_id, RunState.ESCALATED)
        return run.run_id

    def recorded(self, run_id: str, state: RunState, timeout: float = 60) -> None:
        wait_until(
            lambda: (r := self.saga.records.run(run_id)) is not None and r.state == state.value,
            timeout=timeout,
            what=f"run {run_id} recorded {state.value}",
        )


@pytest.fixture(scope="package")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    with postgres_schema("t_web") as (_, database_url):
        data = tmp_path_factory.mktemp("web")
        with deployment(data, {"SAGA_DATABASE_URL": database_url}) as made:
            turns = WorkerProcess(
                "tests.integration.hosted_app",
                env=made.env,
                pool="threads",
                concurrency=10,
                extra_args=["-Q", "saga.turns"],
                logfile=data / "turns.log",
                cwd=ROOT,
            )
            with turns:
                client = Client(settings=Settings.from_env())
                app = create_app(
                    client=client,
                    records=made.saga.records,
                    saga=made.saga,
                    settings=WebSettings(app="tasks.app:saga"),
                )
                operate, _ = tokens.create(made.saga.records, "alice", "operate")
                read, _ = tokens.create(made.saga.records, "bob", "read")
                yield Web(made, app, operate, read, database_url)
                client.store.client.close()


@pytest.fixture
def fresh_world(web: Web) -> Iterator[None]:
    """The demo's systems as new, no fault switched on, before and after the test."""
    systems.clear_switches()
    systems.reset()
    yield
    systems.clear_switches()


@pytest.fixture(scope="module")
def server(web: Web) -> Iterator[str]:
    """``saga serve`` on a free port, ready (``/health/ready``), stopped by its PID."""
    with serving({**web.env, "SAGA_APP": "tasks.app:saga"}, web.deployment.data) as url:
        yield url


@contextmanager
def serving(deployment_env: dict[str, str], data: Path) -> Iterator[str]:
    """``saga serve`` over ``deployment_env`` on a free port, ready, stopped by its PID; its
    output in ``data/serve.log``."""
    port = free_port()
    env = {**os.environ, **deployment_env, "SAGA_API_HOST": "127.0.0.1"}
    log = (data / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "saga.cli", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _ready(url, process)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()


def _ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"saga serve did not become ready at {url}")
        time.sleep(0.2)


def login_value(page: str) -> str:
    """The CSRF value of a login form (or of any console form) in ``page``."""
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, page[:500]
    return found.group(1)
