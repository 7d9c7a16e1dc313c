"""Fixtures shared by every tier.

Services: a Redis (``SAGA_REDIS_URL``, default localhost:6379) and, for the record tests,
PostgreSQL (``SAGA_TEST_POSTGRES_URL``). Where one does not answer, its tests skip with a clear
message on a laptop and fail in CI (``CI=true``), so a broken CI machine is never green.

The matrix (``make test-matrix``) runs the same tests on another broker or store:
``SAGA_TEST_BROKER=amqp`` puts the session's worker on a vhost of the session's own on the
machine's RabbitMQ (``SAGA_TEST_AMQP``), deleted afterwards; ``SAGA_TEST_STORE=sentinel``
puts the stack, the broker and the results on a master, a replica and three sentinels the
session starts on free ports and stops by PID; ``SAGA_TEST_STORE=cluster`` puts the stack on a
Redis Cluster of three masters and three replicas the session starts (the broker and the
results, which cannot be a cluster, stay on the machine's Redis, or the broker on RabbitMQ).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

DEFAULT_REDIS = "redis://localhost:6379"
#: The machine's Redis, as the environment named it before any session fixture set its own.
MACHINE_REDIS = os.environ.get("SAGA_REDIS_URL", DEFAULT_REDIS)
#: Each session takes a block of Redis database indexes, TEST_DB - 3 to TEST_DB + 2: its own
#: (flushed before and after), and those of the tests that need a database to themselves (the
#: engine harness's, the expiry's, the listing's, the RabbitMQ tests', the matrix legs').
#: ``make test`` runs two pytest-xdist workers; each takes the block below the one before.
DB_BLOCK = 6
_XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
TEST_DB = int(os.environ.get("SAGA_TEST_REDIS_DB", "13")) - DB_BLOCK * _XDIST_WORKER
if TEST_DB < 3:
    raise RuntimeError(
        f"pytest-xdist worker {_XDIST_WORKER} has no Redis databases left (its block would "
        f"start at {TEST_DB - 3}): run at most two workers (-n 2), or lower SAGA_TEST_REDIS_DB"
    )
ROOT = Path(__file__).resolve().parents[1]
#: The record tests' PostgreSQL (each test works in a schema of its own: ``postgres_schema``).
POSTGRES_URL = os.environ.get(
    "SAGA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


#: The matrix's axes: the broker (``redis`` or ``amqp``) and the store (``redis`` or
#: ``sentinel``) of the session's worker.
TEST_BROKER = os.environ.get("SAGA_TEST_BROKER", "redis")
TEST_STORE = os.environ.get("SAGA_TEST_STORE", "redis")
AMQP = os.environ.get("SAGA_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")
if TEST_BROKER not in ("redis", "amqp") or TEST_STORE not in ("redis", "sentinel", "cluster"):
    raise RuntimeError(
        f"SAGA_TEST_BROKER={TEST_BROKER!r} SAGA_TEST_STORE={TEST_STORE!r}: the broker is "
        "redis or amqp, the store redis, sentinel or cluster"
    )


def service_missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI must provide it)")
    pytest.skip(message)


@contextlib.contextmanager
def postgres_schema(prefix: str) -> Iterator[tuple[str, str]]:
    """A schema of the caller's own in the test PostgreSQL, dropped afterwards: (its name, the
    URL whose search_path is it). Skips (fails in CI) when PostgreSQL does not answer."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 5})
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError as exc:
        admin.dispose()
        service_missing(f"no PostgreSQL at {POSTGRES_URL} ({exc.orig})")
    separator = "&" if "?" in POSTGRES_URL else "?"
    try:
        yield schema, f"{POSTGRES_URL}{separator}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def redis_url_with_db(url: str, db: int) -> str:
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        return url  # a cluster has database 0 only: the session's cluster is its own
    return re.sub(r"(/\d+)?/?$", "", url, count=1) + f"/{db}"


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@contextlib.contextmanager
def rabbitmq_vhost(prefix: str = "saga-test") -> Iterator[tuple[str, str]]:
    """A vhost of the caller's own on the machine's RabbitMQ, guest allowed everything, deleted
    afterwards: (its name, its AMQP URL). Skips (fails in CI) without a RabbitMQ."""
    if shutil.which("rabbitmqctl") is None:
        service_missing("rabbitmqctl is not installed (a RabbitMQ server on this machine)")
    vhost = f"{prefix}-{uuid.uuid4().hex[:10]}"
    try:
        rabbitmqctl("add_vhost", vhost)
    except (subprocess.CalledProcessError, OSError) as exc:
        service_missing(f"cannot add a RabbitMQ vhost ({exc})")
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield vhost, f"{AMQP}/{vhost}"
    finally:
        rabbitmqctl("delete_vhost", vhost)


@pytest.fixture(scope="session")
def store_base() -> Iterator[str]:
    """The URL of the store the session's tests use, without a database index: the Redis at
    ``SAGA_REDIS_URL``, or (``SAGA_TEST_STORE=sentinel``) a Sentinel deployment of its own."""
    if TEST_STORE == "redis":
        yield MACHINE_REDIS
        return
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    if TEST_STORE == "cluster":
        from tests.reliability.redis_cluster import RedisClusterNodes

        with (
            tempfile.TemporaryDirectory(prefix="saga-cluster-") as directory,
            RedisClusterNodes(Path(directory)) as nodes,
        ):
            yield nodes.url()
        return
    from tests.reliability.sentinel_cluster import SentinelCluster

    with (
        tempfile.TemporaryDirectory(prefix="saga-sentinel-") as directory,
        SentinelCluster(Path(directory)) as cluster,
    ):
        yield cluster.url().rsplit("/", 1)[0]


@pytest.fixture(scope="session")
def redis_url(store_base: str) -> str:
    """A Redis database index of this test session's own, flushed before and after."""
    from saga.redis_urls import redis_client

    url = redis_url_with_db(store_base, TEST_DB)
    client = redis_client(url, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_missing(f"no Redis at {store_base} ({exc}); `make test` starts one for you")
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    from saga.redis_urls import redis_client as client_of

    client = client_of(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def broker_url(redis_url: str) -> Iterator[str | None]:
    """The session's broker: a vhost of its own with ``SAGA_TEST_BROKER=amqp``; otherwise
    ``None`` on a Sentinel store (the broker follows ``SAGA_REDIS_URL`` through the sentinels),
    the machine's Redis (the session's database) beside a cluster store, and the test Redis on
    a plain one."""
    if TEST_BROKER == "amqp":
        with rabbitmq_vhost("saga-session") as (_, url):
            yield url
        return
    if TEST_STORE == "cluster":
        url = redis_url_with_db(MACHINE_REDIS, TEST_DB)
        client = redis.Redis.from_url(url, socket_timeout=2)
        client.flushdb()  # the session's own database, as the store's is flushed
        yield url
        client.flushdb()
        client.close()
        return
    yield None if TEST_STORE == "sentinel" else redis_url


@pytest.fixture(scope="session")
def saga_env(
    redis_url: str, broker_url: str | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The environment of the demo app, in this process and in the workers it starts. Where
    the broker or the results are not named, they follow ``SAGA_REDIS_URL``, as in a
    deployment that names only its store."""
    from saga.redis_urls import redis_client

    data = tmp_path_factory.mktemp("demo-data")
    env = {
        "SAGA_REDIS_URL": redis_url,
        "SAGA_DEMO_DATA": str(data),
        "SAGA_DATABASE_URL": f"sqlite:///{data}/saga.db",
        "PYTHONPATH": str(ROOT),
    }
    if broker_url is not None:
        env["SAGA_BROKER_URL"] = broker_url
    if TEST_STORE == "redis" and TEST_BROKER == "redis":
        env["SAGA_RESULT_BACKEND"] = redis_url
    if TEST_STORE == "cluster" and TEST_BROKER == "redis":
        env["SAGA_RESULT_BACKEND"] = str(broker_url)
    followers = ("SAGA_BROKER_URL", "SAGA_RESULT_BACKEND")
    saved = {k: os.environ.get(k) for k in (*env, *followers)}
    for key in followers:
        os.environ.pop(key, None)
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    client = redis_client(redis_url)
    client.flushdb()
    client.close()


#: Modules that read the environment once, when first imported (the Celery configuration and
#: the apps built on it): one imported under a private deployment's variables must not keep
#: them for the rest of the session.
READ_ENV_ONCE = (
    "celeryconfig",
    "saga.celery_defaults",
    "tasks.app",
    "tests.integration.hosted_app",
    "tests.integration.late_tools_app",
    "tests.integration.telemetry_setup",
)


def forget_modules_read_env_once(keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Drop ``READ_ENV_ONCE`` (but ``keep``) from ``sys.modules``: the next import reads the
    environment as it is then."""
    for name in READ_ENV_ONCE:
        if name not in keep:
            sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _forget_modules_imported_by_the_test() -> Iterator[None]:
    """What a test (its body or its function fixtures) first imported of ``READ_ENV_ONCE`` read
    the test's environment, perhaps a deployment of its own: the next importer reads its own.
    (Serially, the session's fixtures happened to import them first; under xdist any file may
    run first in a process.)"""
    imported_before = {name for name in READ_ENV_ONCE if name in sys.modules}
    yield
    forget_modules_read_env_once(keep=imported_before)


@pytest.fixture(scope="session")
def demo_app(saga_env: dict[str, str]) -> Any:
    """``tasks.app`` as the session's environment configures it: imported afresh now, since
    a test that ran before in this process (under xdist, any file may) could have imported it,
    or its Celery configuration, under the variables of a deployment of its own."""
    forget_modules_read_env_once()
    from tasks import app

    return app


@pytest.fixture(scope="session")
def worker(saga_env: dict[str, str], demo_app: Any) -> Iterator[Any]:
    """One real Celery worker (two pool processes) for the session, stopped by PID at the end."""
    from saga.testing import WorkerProcess

    with WorkerProcess("tasks.app", env=saga_env, concurrency=2, cwd=ROOT) as process:
        yield process
