"""What ``saga drill`` runs a drill on when no test session gives it one: a private
``redis-server`` (the stack, the broker, the results), the records in a temporary SQLite file,
fault injection on, and a real worker on the app, all stopped by PID when it ends."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saga.errors import ConfigurationError
from saga.fault_points import FAULTS_ENV
from saga.testing.processes import RedisServer, WorkerProcess

if TYPE_CHECKING:
    from saga.engine import Saga


def load(spec: str, what: str) -> Any:
    """``module:attr`` (or a module alone, for an app holding one ``Saga``) → the object."""
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ConfigurationError(f"{what} {spec!r}: {module_name} has no {attr}") from None
    from saga.engine import Saga

    sagas = [v for v in vars(module).values() if isinstance(v, Saga)]
    if len(sagas) != 1:
        raise ConfigurationError(f"{what} {spec!r}: name the Saga as module:attr")
    return sagas[0]


@contextmanager
def drill_session(
    app_spec: str,
    *,
    cwd: Path,
    concurrency: int = 2,
    time_limit: int = 5,
    log: Callable[[str], None] = lambda line: None,
    env: Mapping[str, str] | None = None,
    check: Callable[[Saga], None] | None = None,
) -> Iterator[tuple[Saga, WorkerProcess]]:
    """The app imported against a private Redis, and a worker on it; ``env`` more of the
    worker's environment (a served fake model's, ``FakeModel.environ``); ``check`` is told the
    app before the worker starts (a bad argument fails fast)."""
    from saga.constants import TURN_QUEUE
    from saga.engine import Saga

    directory = Path(tempfile.mkdtemp(prefix="saga-drill-"))
    try:
        server = RedisServer("--maxmemory-policy", "noeviction", directory=directory / "redis")
        with server:
            url = f"{server.url}/0"
            path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH", "")) if p)
            environ = {
                **(env or {}),
                "SAGA_REDIS_URL": url,
                "SAGA_BROKER_URL": url,
                "SAGA_RESULT_BACKEND": url,
                "SAGA_DATABASE_URL": f"sqlite:///{directory / 'saga.db'}",
                FAULTS_ENV: "1",
                "SAGA_TASK_TIME_LIMIT": str(time_limit),
                "PYTHONPATH": path,
            }
            os.environ.update(environ)  # before the app is imported: its settings read them
            if str(cwd) not in sys.path:
                sys.path.insert(0, str(cwd))
            saga = load(app_spec, "--app")
            if not isinstance(saga, Saga):
                raise ConfigurationError(f"--app {app_spec!r} is not a Saga")
            if saga.settings.redis_url != url or saga.faults is None:
                raise ConfigurationError(
                    f"{app_spec} was imported before the drill set SAGA_REDIS_URL"
                )
            if check is not None:
                check(saga)
            queues = f"{saga.app.conf.task_default_queue or 'celery'},{TURN_QUEUE}"
            worker = WorkerProcess(
                app_spec.partition(":")[0],
                env=environ,
                concurrency=concurrency,
                extra_args=["-Q", queues],
                logfile=directory / "worker.log",
                cwd=cwd,
            )
            log(f"drill: redis-server on {server.port}, worker log {worker.logfile}")
            with worker:
                yield saga, worker
    finally:
        shutil.rmtree(directory, ignore_errors=True)
