"""A private deployment for tests that configure the worker itself (notification sinks, a
metrics port): its own ``redis-server``, records database, demo data and worker, so the
session's shared worker (which has none of these settings) never takes its tasks.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from saga import Saga, Settings
from saga.notifications import NotifySettings
from saga.testing import RedisServer, WorkerProcess
from tests.conftest import READ_ENV_ONCE, ROOT, forget_modules_read_env_once, service_missing

#: Short, so a killed worker's message comes back within a test: above the time limit plus
#: the longest retry delay of any demo tool or notice (0.8 s) plus the guard's 1 s margin.
VISIBILITY_TIMEOUT = 8
TIME_LIMIT = 5


class Deployment:
    """One Redis, one records database, one worker, and a ``Saga`` in the test process."""

    def __init__(self, data: Path, extra_env: Mapping[str, str], worker_args: list[str]) -> None:
        self.data = data
        self.redis = RedisServer(directory=data / "redis").start()
        url = self.redis.url + "/0"
        self.env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": url,
            "SAGA_RESULT_BACKEND": url,
            "SAGA_DEMO_DATA": str(data),
            "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
            "SAGA_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
            "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
            "SAGA_TESTING_FAULTS": "1",
            "PYTHONPATH": str(ROOT),
            **extra_env,
        }
        self.worker_args = worker_args
        self.workers: list[WorkerProcess] = []
        self.saga: Any = None

    def start(self) -> Deployment:
        from tasks.tools import tools

        app = Celery("private-deployment")
        app.config_from_object("celeryconfig")
        url = self.env["SAGA_REDIS_URL"]
        app.conf.update(
            broker_url=url,
            result_backend=url,
            broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
            task_time_limit=TIME_LIMIT,
            task_soft_time_limit=TIME_LIMIT - 1,
        )
        settings = Settings(
            redis_url=url,
            database_url=self.env["SAGA_DATABASE_URL"],
            notifications=NotifySettings.from_env(),
        )
        self.saga = Saga(app, tools, settings)
        self.start_worker()
        return self

    def start_worker(self) -> WorkerProcess:
        worker = WorkerProcess(
            "tasks.app",
            env=self.env,
            concurrency=2,
            cwd=ROOT,
            extra_args=self.worker_args,
            logfile=self.data / f"worker-{len(self.workers)}.log",
        )
        self.workers.append(worker)
        return worker.start(timeout=60)

    @property
    def worker(self) -> WorkerProcess:
        return self.workers[-1]

    def worker_log(self) -> str:
        return "".join(w.log() for w in self.workers)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.saga is not None:
            self.saga.store.client.close()
            if self.saga.core._records is not None:
                self.saga.records.dispose()
        self.redis.stop()


@contextmanager
def deployment(
    data: Path, extra_env: Mapping[str, str], worker_args: list[str] | None = None
) -> Iterator[Deployment]:
    """Started with the environment set in this process too (the demo systems and the
    ``Saga`` read it), and everything put back afterwards."""
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    from tasks import systems

    made = Deployment(data, extra_env, worker_args or [])
    # These modules read the environment once, when first imported: one imported under this
    # deployment's variables must not keep them for the rest of the session.
    imported_before = {name for name in READ_ENV_ONCE if name in sys.modules}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in made.env.items():
            patch.setenv(key, value)
        try:
            made.start()
            systems.reset()
            yield made
        finally:
            made.stop()
            systems.dispose_engines()
            forget_modules_read_env_once(keep=imported_before)
