"""Passwords beside password-less URLs (``SAGA_REDIS_PASSWORD[_FILE]``,
``SAGA_DATABASE_PASSWORD[_FILE]``): put in percent-encoded, so that each client (redis-py,
kombu, SQLAlchemy) reads back exactly the password, whatever it holds; and how an escalation's
commands name the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import redis
from kombu.utils.url import url_to_parts
from sqlalchemy.engine import make_url

from saga.errors import ConfigurationError
from saga.escalations.invocation import app_spec_of, saga_command
from saga.settings import Settings, secret_from_env, with_password

ROOT = Path(__file__).resolve().parents[2]
NASTY = "p@ss:w/rd%40#frag?x=1 y"


def test_a_password_full_of_url_characters_reaches_every_client_intact() -> None:
    url = with_password("redis://saga@redis:6379/2", NASTY)
    assert url.startswith("redis://saga:") and url.endswith("@redis:6379/2")
    pool = redis.ConnectionPool.from_url(url)
    assert pool.connection_kwargs["password"] == NASTY
    assert pool.connection_kwargs["username"] == "saga"
    assert (pool.connection_kwargs["host"], pool.connection_kwargs["db"]) == ("redis", 2)
    parts = url_to_parts(url)  # what kombu (the broker) reads
    assert (parts.username, parts.password, parts.hostname) == ("saga", NASTY, "redis")
    database = make_url(with_password("postgresql+psycopg://saga@db:5432/saga", NASTY))
    assert (database.username, database.password, database.host) == ("saga", NASTY, "db")


def test_a_url_with_its_own_password_or_no_host_is_left_alone() -> None:
    assert with_password("redis://u:own@h/0", NASTY) == "redis://u:own@h/0"
    assert with_password("sqlite:///saga.db", NASTY) == "sqlite:///saga.db"
    assert with_password("redis://h:6379/0", None) == "redis://h:6379/0"
    assert url_to_parts(with_password("redis://h:6379/0", NASTY)).password == NASTY


def test_the_password_comes_from_a_file_without_its_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "redis_password"
    secret.write_text(NASTY + "\n")
    monkeypatch.setenv("SAGA_REDIS_URL", "redis://saga@redis:6379/2")
    monkeypatch.setenv("SAGA_REDIS_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("SAGA_DATABASE_URL", "postgresql+psycopg://saga@db/saga")
    monkeypatch.setenv("SAGA_DATABASE_PASSWORD", NASTY)
    settings = Settings.from_env()
    assert redis.ConnectionPool.from_url(settings.redis_url).connection_kwargs["password"] == NASTY
    assert make_url(settings.database_url).password == NASTY
    monkeypatch.setenv("SAGA_REDIS_PASSWORD", "x")
    with pytest.raises(ConfigurationError, match="not both"):
        secret_from_env("SAGA_REDIS_PASSWORD")
    monkeypatch.delenv("SAGA_REDIS_PASSWORD")
    monkeypatch.setenv("SAGA_REDIS_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="SAGA_REDIS_PASSWORD_FILE: cannot read"):
        secret_from_env("SAGA_REDIS_PASSWORD")


def test_celery_gets_the_password_in_the_broker_and_result_urls(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(NASTY)
    env = {
        **os.environ,
        "SAGA_BROKER_URL": "redis://saga@redis:6379/0",
        "SAGA_RESULT_BACKEND": "redis://saga@redis:6379/1",
        "SAGA_REDIS_URL": "redis://saga@redis:6379/2",
        "SAGA_REDIS_PASSWORD_FILE": str(secret),
    }
    code = (
        "import json, saga.celery_defaults as c; "
        "print(json.dumps([c.broker_url, c.result_backend]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    broker, backend = json.loads(done.stdout)
    assert url_to_parts(broker).password == url_to_parts(backend).password == NASTY
    assert url_to_parts(backend).path == "1"


def test_a_rabbitmq_broker_gets_its_own_password_never_the_redis_one(tmp_path: Path) -> None:
    """``SAGA_BROKER_PASSWORD_FILE`` fills in an AMQP URL (a compose secret); the store's
    password stays Redis's; every reader of the broker URL (Celery's settings, the client,
    ``saga doctor``) puts it in."""
    (tmp_path / "rabbit").write_text(NASTY + "\n")
    (tmp_path / "redis").write_text("redis-only")
    env = {
        **os.environ,
        "SAGA_BROKER_URL": "amqp://saga@rabbitmq:5672/saga",
        "SAGA_REDIS_URL": "redis://saga@redis:6379/2",
        "SAGA_BROKER_PASSWORD_FILE": str(tmp_path / "rabbit"),
        "SAGA_REDIS_PASSWORD_FILE": str(tmp_path / "redis"),
    }
    env.pop("SAGA_BROKER_PASSWORD", None)
    env.pop("SAGA_RESULT_BACKEND", None)
    code = (
        "import json, saga.celery_defaults as c; from saga.client import resolved; "
        "from saga.cli.doctor_broker import broker_url; "
        "print(json.dumps([c.broker_url, c.result_backend, resolved(None, None, None)[2], "
        "broker_url(None, 'redis://unused')]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    broker, backend, client, doctor = json.loads(done.stdout)
    assert broker == client == doctor
    parts = url_to_parts(broker)
    assert (parts.scheme, parts.username, parts.password) == ("amqp", "saga", NASTY)
    assert (parts.hostname, parts.path) == ("rabbitmq", "saga")
    assert url_to_parts(backend).password == "redis-only"  # the results are the store's Redis
    assert url_to_parts(backend).hostname == "redis"
    # One with its own password keeps it.
    env["SAGA_BROKER_URL"] = "amqp://saga:mine@rabbitmq:5672/saga"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert url_to_parts(json.loads(done.stdout)[0]).password == "mine"


def test_the_app_is_the_setting_else_the_module_that_holds_the_saga(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saga = types.SimpleNamespace(app=types.SimpleNamespace(main="myproject.worker"))
    assert app_spec_of(saga, "given.module:saga") == "given.module:saga"
    assert app_spec_of(saga) == ""  # held by no module
    for name, attr in (("myproject.api", "saga"), ("myproject.worker", "the_saga")):
        module = types.ModuleType(name)
        setattr(module, attr, saga)
        monkeypatch.setitem(sys.modules, name, module)
    # the Celery app's main module first, whatever the attribute's name
    assert app_spec_of(saga) == "myproject.worker:the_saga"
    assert saga_command(app_spec_of(saga)) == "saga --app myproject.worker:the_saga"
    assert saga_command("") == "saga"


def test_the_records_default_is_per_user_never_the_current_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from saga.settings import sqlite_file

    monkeypatch.delenv("SAGA_DATABASE_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert Settings.from_env().database_url == f"sqlite:///{tmp_path}/xdg/saga/saga.db"
    assert Settings().database_url == f"sqlite:///{tmp_path}/xdg/saga/saga.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    assert Settings.from_env().database_url == f"sqlite:///{tmp_path}/.local/share/saga/saga.db"
    # the file a URL names: absolute, relative, none for memory or another database
    assert sqlite_file("sqlite:////srv/x.db") == Path("/srv/x.db")
    assert sqlite_file("sqlite:///x.db?mode=ro") == Path("x.db")
    assert sqlite_file("sqlite:///:memory:") is None
    assert sqlite_file("postgresql+psycopg://u@h/db") is None
