"""Fixtures shared by every tier.

Services: a Redis (``SAGA_REDIS_URL``, default localhost:6379) and, for the record tests,
PostgreSQL (``SAGA_TEST_POSTGRES_URL``). Where one does not answer, its tests skip with a clear
message on a laptop and fail in CI (``CI=true``), so a broken CI machine is never green.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

DEFAULT_REDIS = "redis://localhost:6379"
#: The test session owns this Redis database index: flushed before and after.
TEST_DB = int(os.environ.get("SAGA_TEST_REDIS_DB", "13"))
ROOT = Path(__file__).resolve().parents[1]
#: The record tests' PostgreSQL (each test works in a schema of its own: ``postgres_schema``).
POSTGRES_URL = os.environ.get(
    "SAGA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
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
    return re.sub(r"(/\d+)?/?$", "", url, count=1) + f"/{db}"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis database index of this test session's own, flushed before and after."""
    base = os.environ.get("SAGA_REDIS_URL", DEFAULT_REDIS)
    url = redis_url_with_db(base, TEST_DB)
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_missing(f"no Redis at {base} ({exc}); `make test` starts one for you")
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def saga_env(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of the demo app, in this process and in the workers it starts."""
    data = tmp_path_factory.mktemp("demo-data")
    env = {
        "SAGA_REDIS_URL": redis_url,
        "SAGA_BROKER_URL": redis_url,
        "SAGA_RESULT_BACKEND": redis_url,
        "SAGA_DEMO_DATA": str(data),
        "SAGA_DATABASE_URL": f"sqlite:///{data}/saga.db",
        "PYTHONPATH": str(ROOT),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    redis.Redis.from_url(redis_url).flushdb()


@pytest.fixture(scope="session")
def demo_app(saga_env: dict[str, str]) -> Any:
    """``tasks.app``, imported only once the environment points at the test's Redis."""
    from tasks import app

    return app


@pytest.fixture(scope="session")
def worker(saga_env: dict[str, str], demo_app: Any) -> Iterator[Any]:
    """One real Celery worker (two pool processes) for the session, stopped by PID at the end."""
    from saga.testing import WorkerProcess

    with WorkerProcess("tasks.app", env=saga_env, concurrency=2, cwd=ROOT) as process:
        yield process
