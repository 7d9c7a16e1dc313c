"""A private Redis, a private saga and workers for each reliability test.

These tests kill workers and Redis itself, so none of them may share a server with anything
else: each gets its own ``redis-server`` on a free port, its own demo data directory and
records database, and workers it starts and stops by PID.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from saga import Saga, Settings
from saga.testing import Faults, RedisServer, WorkerProcess
from saga.tools import ToolRegistry
from tests.conftest import ROOT, service_missing

#: Short enough that a whole-worker kill is recovered within a test, and still above the time
#: limit plus the longest retry delay of any demo tool (0.8 s) plus the guard's 1 s margin (the
#: start-up guard checks it).
VISIBILITY_TIMEOUT = 8
TIME_LIMIT = 5


@dataclass
class Private:
    """Everything one reliability test owns."""

    redis: RedisServer
    env: dict[str, str]
    saga: Saga
    faults: Faults
    data: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    #: The broker's and results' own Redis, without persistence (``private(broker=True)``):
    #: the split topology of docs/deployment.md. None: the store's Redis is the broker too.
    broker: RedisServer | None = None

    @property
    def url(self) -> str:
        return self.redis.url

    def worker(self, app: str = "tasks.app", concurrency: int = 1, **kwargs: Any) -> WorkerProcess:
        """Start a worker on this test's Redis; it is stopped at teardown in any case."""
        process = WorkerProcess(
            app,
            env=self.env,
            concurrency=concurrency,
            cwd=ROOT,
            logfile=self.data / f"worker-{len(self.workers)}.log",
            **kwargs,
        )
        self.workers.append(process)
        return process.start()

    def restart_redis(self) -> None:
        """SIGKILL Redis and start it again on the same port and files (AOF replay)."""
        self.redis.kill()
        self.redis.start()

    def restart_broker(self) -> None:
        """SIGKILL the broker's own Redis and start it again: with no persistence, it comes
        back empty (every queued message lost)."""
        assert self.broker is not None, "private(broker=True) gives the broker a Redis of its own"
        self.broker.kill()
        self.broker.start()


def _app(url: str, visibility_timeout: int) -> Celery:
    app = Celery("reliability")
    app.config_from_object("celeryconfig")
    app.conf.update(
        broker_url=url,
        result_backend=url,
        broker_transport_options={"visibility_timeout": visibility_timeout},
        task_time_limit=TIME_LIMIT,
        task_soft_time_limit=TIME_LIMIT - 1,
        broker_connection_retry_on_startup=True,
    )
    return app


@pytest.fixture
def private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Private]]:
    """Factory: ``private(redis_args=..., run_deadline=..., registry=..., ...)``; the test and
    its workers share the settings given (the workers through the environment)."""
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    made: list[Private] = []

    def make(
        redis_args: Sequence[str] = (),
        run_deadline: int = 900,
        registry: ToolRegistry | None = None,
        visibility_timeout: int = VISIBILITY_TIMEOUT,
        extra_env: dict[str, str] | None = None,
        max_redeliveries: int = Settings.max_redeliveries,
        broker: bool = False,
    ) -> Private:
        from tasks import systems
        from tasks.tools import tools

        data = tmp_path / f"private-{len(made)}"
        data.mkdir()
        redis_server = RedisServer(*redis_args, directory=data / "redis").start()
        url = redis_server.url + "/0"
        broker_server = None
        if broker:
            broker_args = ("--appendonly", "no")
            broker_server = RedisServer(*broker_args, directory=data / "broker").start()
        broker_url = url if broker_server is None else broker_server.url + "/0"
        env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": broker_url,
            "SAGA_RESULT_BACKEND": broker_url,
            "SAGA_DEMO_DATA": str(data),
            "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
            "SAGA_VISIBILITY_TIMEOUT": str(visibility_timeout),
            "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
            "SAGA_RUN_DEADLINE": str(run_deadline),
            "SAGA_MAX_REDELIVERIES": str(max_redeliveries),
            "SAGA_TESTING_FAULTS": "1",
            "PYTHONPATH": str(ROOT),
            **(extra_env or {}),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = Settings(
            redis_url=url,
            database_url=env["SAGA_DATABASE_URL"],
            run_deadline_seconds=run_deadline,
            max_redeliveries=max_redeliveries,
        )
        saga = Saga(_app(broker_url, visibility_timeout), registry or tools, settings)
        systems.reset()
        assert saga.faults is not None  # the workers strike; the test writes the rules
        faults = Faults(saga.store.client)
        private = Private(redis_server, env, saga, faults, data, broker=broker_server)
        made.append(private)
        return private

    yield make

    from tasks import systems

    for private in made:
        for process in private.workers:
            process.stop()
        private.saga.store.client.close()
        if private.saga.core._records is not None:
            private.saga.records.dispose()
        private.redis.stop()
        if private.broker is not None:
            private.broker.stop()
    systems.dispose_engines()
    os.environ.pop("SAGA_TESTING_FAULTS", None)
