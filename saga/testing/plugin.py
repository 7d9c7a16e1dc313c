"""saga's pytest plugin: a private Redis, a real worker on your app, per-tool faults and a fake
model, as fixtures (``docs/testing.md``). ``pip install 'saga-compensation[testing]'`` registers
it (entry point ``pytest11``); nothing here runs unless a test asks for one of its fixtures.

Options (command line, or the ini file):

- ``--saga-app`` / ``saga_app``: ``module:attr`` of your ``Saga`` (``module`` alone if it holds
  one); the worker runs ``celery -A module``. Or override the ``saga_app_path`` fixture.
- ``--saga-redis-url`` / ``saga_redis_url`` / ``SAGA_TEST_REDIS_URL``: a Redis to use (database
  ``--saga-redis-db`` / ``saga_redis_db``, default 15, flushed before and after the session)
  instead of a private ``redis-server`` on a free port.
- ``--saga-include`` / ``saga_include``: modules the worker imports besides the app's, comma
  separated (Celery's ``--include``): where agents or tools are declared in a module the app
  does not import. The session imports them too, after the app.
- ``--saga-worker-concurrency`` / ``saga_worker_concurrency``: the worker's pool size (2).
- ``--saga-task-time-limit`` / ``saga_task_time_limit``: ``SAGA_TASK_TIME_LIMIT`` for the app
  (default 5 s). A delivery killed mid-step holds its step's lease for the time limit plus 2 s;
  a short one lets a kill test see the redelivery within seconds.
- ``--saga-drill-max-cases`` / ``saga_drill_max_cases`` and ``--saga-drill-seed`` /
  ``saga_drill_seed``: the budget of ``saga_drill`` (fault cases sampled with the seed) when a
  test does not set one.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

# Types only: the plugin loads with every test session; its fixtures import these on use.
if TYPE_CHECKING:
    from saga.engine import Saga
    from saga.testing.drill import DrillReport, Scenario
    from saga.testing.drill_hosted import HostedScenario
    from saga.testing.fake_models import FakeModel
    from saga.testing.faults import Faults
    from saga.testing.processes import WorkerProcess

#: The database the kit takes on a Redis it is given (``--saga-redis-db``).
DEFAULT_REDIS_DB = 15
REDIS_URL_ENV = "SAGA_TEST_REDIS_URL"
#: Seconds: a killed delivery's lease lasts this plus 2 s, so a kill test recovers quickly.
DEFAULT_TIME_LIMIT = 5


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("saga", "saga's testing kit (docs/testing.md)")
    options = (
        ("app", "module:attr of the Saga under test; the worker runs `celery -A module`"),
        ("redis-url", f"a Redis to use instead of a private redis-server (or ${REDIS_URL_ENV})"),
        ("redis-db", f"the database taken on that Redis, flushed (default {DEFAULT_REDIS_DB})"),
        ("include", "modules the worker imports besides the app's, comma separated (--include)"),
        ("worker-concurrency", "the test worker's pool size (default 2)"),
        ("task-time-limit", f"SAGA_TASK_TIME_LIMIT in the tests (default {DEFAULT_TIME_LIMIT})"),
        ("drill-max-cases", "saga_drill: play at most N fault cases, sampled (default: all)"),
        ("drill-seed", "saga_drill: the sampling's seed (default 0)"),
    )
    for name, help_text in options:
        ini = f"saga_{name.replace('-', '_')}"
        group.addoption(f"--saga-{name}", dest=ini, default=None, help=help_text)
        parser.addini(ini, help_text, default="")


def _includes(config: pytest.Config) -> list[str]:
    """``saga_include`` as module names: commas or whitespace between them (an ini value may
    span lines)."""
    return [name for name in re.split(r"[,\s]+", _option(config, "saga_include")) if name]


def _option(config: pytest.Config, name: str) -> str:
    value = config.getoption(name)
    return str(value if value is not None else config.getini(name) or "")


@pytest.fixture(scope="session")
def saga_app_path(pytestconfig: pytest.Config) -> str:
    """``module:attr`` of the app under test (override this fixture to compute it)."""
    path = _option(pytestconfig, "saga_app")
    if not path:
        pytest.fail(
            "saga's testing kit needs your app: set saga_app = module:attr in the ini file, pass "
            "--saga-app module:attr, or override the saga_app_path fixture",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def saga_redis_url(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A Redis database of this session's own: a private ``redis-server`` on a free port
    (``noeviction``, as saga requires), or a database of the Redis you named, flushed."""
    # Imported on use: the plugin loads with every test session.
    import redis

    from saga.redis_urls import redis_client
    from saga.testing.processes import RedisServer

    given = _option(pytestconfig, "saga_redis_url") or os.environ.get(REDIS_URL_ENV, "")
    if not given:
        directory = tmp_path_factory.mktemp("saga-redis")
        with RedisServer("--maxmemory-policy", "noeviction", directory=directory) as server:
            yield f"{server.url}/0"
        return
    db = int(_option(pytestconfig, "saga_redis_db") or DEFAULT_REDIS_DB)
    url = re.sub(r"(/\d+)?/?$", "", given, count=1) + f"/{db}"
    client = redis_client(url, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"no Redis at {given} ({exc}): unset it to use a private one", pytrace=False)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@pytest.fixture(scope="session")
def _saga_model_server() -> Iterator[FakeModel]:
    # Imported on use: the plugin loads with every test session.
    from saga.extras import missing

    try:
        # Imported on use: the plugin loads with every test session.
        from saga.testing.fake_models import FakeModel
    except ModuleNotFoundError as exc:
        error = missing(exc, "for saga's pytest plugin")
        if error is None:
            raise
        pytest.fail(str(error), pytrace=False)

    model = FakeModel()
    with model.serve():
        yield model


@pytest.fixture
def saga_model(_saga_model_server: FakeModel) -> FakeModel:
    """A scripted model on a loopback port that the worker's SDK clients reach through
    ``OPENAI_BASE_URL`` / ``ANTHROPIC_BASE_URL``, with an empty script for each test:
    ``saga_model.play([...])`` sets it, ``saga_model.requests`` holds what was asked."""
    _saga_model_server.play([])
    return _saga_model_server


@pytest.fixture(scope="session")
def saga_test_env(
    saga_redis_url: str,
    _saga_model_server: FakeModel,
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """The environment of the app under test, in this process (for the session) and in the
    worker: the session's Redis as stack, broker and results, records in a temporary SQLite
    file, fault injection on, a short task time limit, the SDKs pointed at ``saga_model``."""
    data = tmp_path_factory.mktemp("saga-data")
    root = str(pytestconfig.rootpath)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "SAGA_REDIS_URL": saga_redis_url,
        "SAGA_BROKER_URL": saga_redis_url,
        "SAGA_RESULT_BACKEND": saga_redis_url,
        "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
        "SAGA_TESTING_FAULTS": "1",
        "SAGA_TASK_TIME_LIMIT": _option(pytestconfig, "saga_task_time_limit")
        or str(DEFAULT_TIME_LIMIT),
        "PYTHONPATH": path,
        **_saga_model_server.environ(_saga_model_server.url),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def saga_app(
    saga_app_path: str, saga_test_env: dict[str, str], pytestconfig: pytest.Config
) -> Saga:
    """Your ``Saga``, imported once the environment points at the session's Redis."""
    # Imported on use: the plugin loads with every test session.
    from saga.engine import Saga

    module_name, _, attr = saga_app_path.partition(":")
    root = str(pytestconfig.rootpath)
    if root not in sys.path:
        sys.path.append(root)  # the worker imports it from there too (its cwd)
    module = importlib.import_module(module_name)
    if attr:
        found = getattr(module, attr, None)
    else:
        sagas = [v for v in vars(module).values() if isinstance(v, Saga)]
        found = sagas[0] if len(sagas) == 1 else None
    if not isinstance(found, Saga):
        what = f"{module_name}.{attr}" if attr else f"one Saga in {module_name}"
        pytest.fail(f"saga_app = {saga_app_path!r}: no {what}", pytrace=False)
    for included in _includes(pytestconfig):  # their agents and tools, known here too
        importlib.import_module(included)
    if found.settings.redis_url != saga_test_env["SAGA_REDIS_URL"] or found.faults is None:
        pytest.fail(
            f"{module_name} was imported before the kit set SAGA_REDIS_URL (it uses "
            f"{found.settings.redis_url}): import your app inside the tests, or take it from "
            "the saga_app fixture, not at the top of a test module or conftest",
            pytrace=False,
        )
    return found


@pytest.fixture(scope="session")
def _saga_worker_process(
    saga_app_path: str,
    saga_app: Saga,
    saga_test_env: dict[str, str],
    pytestconfig: pytest.Config,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WorkerProcess]:
    # Imported on use: the plugin loads with every test session.
    from saga.constants import TURN_QUEUE
    from saga.testing.processes import WorkerProcess

    queues = f"{saga_app.app.conf.task_default_queue or 'celery'},{TURN_QUEUE}"
    includes = _includes(pytestconfig)
    process = WorkerProcess(
        saga_app_path.partition(":")[0],
        env=saga_test_env,
        concurrency=int(_option(pytestconfig, "saga_worker_concurrency") or 2),
        extra_args=["-Q", queues, *(["--include", ",".join(includes)] if includes else [])],
        logfile=tmp_path_factory.mktemp("saga-worker") / "worker.log",
        cwd=pytestconfig.rootpath,
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def saga_worker(_saga_worker_process: WorkerProcess) -> WorkerProcess:
    """A real Celery worker on your app (its tools and its agents' turns), shared by the
    session and started again if a test killed it. ``.log()`` is its log; ``.restart()``."""
    if not _saga_worker_process.alive():
        _saga_worker_process.restart()
    return _saga_worker_process


@pytest.fixture
def saga_faults(saga_app: Saga) -> Iterator[Faults]:
    """Faults for the worker to meet, cleared before and after each test:
    ``saga_faults.tool("charge_card").fail_after_effect()``, ``.kill_worker(at=...)``,
    ``.fail_compensation(times=k)``, ``.fail_before_effect(nth=2)``."""
    # Imported on use: the plugin loads with every test session.
    from saga.testing.faults import Faults

    faults = Faults(saga_app.store.client, known_tools=[t.name for t in saga_app.registry])
    faults.clear()
    yield faults
    faults.clear()


class SagaDrill:
    """``saga_drill(scenario)``: the drill (``saga.testing.drill``) on the session's worker;
    fails the test with the fault x outcome matrix on any mismatch. ``.run(...)`` returns the
    report without failing. A ``HostedScenario`` is played by its agent, its model the
    session's ``saga_model`` (``saga.testing.drill_hosted``)."""

    def __init__(
        self, saga: Saga, worker: WorkerProcess, config: pytest.Config, model: FakeModel
    ) -> None:
        self.saga = saga
        self.worker = worker
        self.model = model
        max_cases = _option(config, "saga_drill_max_cases")
        self.max_cases = int(max_cases) if max_cases else None
        self.seed = int(_option(config, "saga_drill_seed") or 0)

    def run(
        self,
        scenario: Scenario | HostedScenario,
        *,
        max_cases: int | None = None,
        seed: int | None = None,
        kinds: list[str] | None = None,
        timeout: float = 60.0,
    ) -> DrillReport:
        # Imported on use: the plugin loads with every test session.
        from saga.testing.drill import Drill
        from saga.testing.drill_hosted import HostedDrill, HostedScenario

        options: dict[str, Any] = {"timeout": timeout, "progress": print, "worker": self.worker}
        drill = (
            HostedDrill(self.saga, scenario, self.model, **options)
            if isinstance(scenario, HostedScenario)
            else Drill(self.saga, scenario, **options)
        )
        try:
            return drill.run(
                max_cases=self.max_cases if max_cases is None else max_cases,
                seed=self.seed if seed is None else seed,
                kinds=kinds,
            )
        finally:
            self.model.play([])  # the session's model, as the next test expects to find it

    def __call__(self, scenario: Scenario | HostedScenario, **options: Any) -> DrillReport:
        # Imported on use: the plugin loads with every test session.
        from saga.testing.drill_report import to_text

        report = self.run(scenario, **options)
        if not report.ok:
            pytest.fail(f"saga drill found mismatches:\n{to_text(report)}", pytrace=False)
        return report


@pytest.fixture
def saga_drill(
    saga_app: Saga,
    saga_worker: WorkerProcess,
    pytestconfig: pytest.Config,
    _saga_model_server: FakeModel,
) -> SagaDrill:
    """Replay a scenario (a function taking a ``Run``, or a ``HostedScenario``: an agent, its
    input and its model's script) once per fault on the session's worker and judge each run
    by the tools' ``verify``: ``saga_drill(scenario, max_cases=8, seed=1)`` fails the test on
    any mismatch; ``saga_drill.run(...)`` returns the report."""
    return SagaDrill(saga_app, saga_worker, pytestconfig, _saga_model_server)
