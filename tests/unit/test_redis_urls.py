"""Sentinel URLs: both spellings read, the store's turned into kombu's, the master's name
passed to kombu and Celery, and a malformed one refused where it is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from saga.errors import ConfigurationError
from saga.redis_urls import (
    MASTER_ENV,
    PASSWORD_ENV,
    SentinelUrl,
    is_tls,
    kombu_url,
    parse_sentinel,
    sentinel_transport_options,
)
from saga.settings import Settings, check_redis_url
from tests.conftest import ROOT

STORE = "redis+sentinel://:p%40ss@s1:26380,s2,[::1]:26382/main/3"


@pytest.fixture(autouse=True)
def _no_sentinel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (MASTER_ENV, PASSWORD_ENV, f"{PASSWORD_ENV}_FILE", "SAGA_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


def test_the_store_spelling_names_sentinels_master_db_and_password() -> None:
    assert parse_sentinel(STORE) == SentinelUrl(
        (("s1", 26380), ("s2", 26379), ("::1", 26382)), "main", 3, None, "p@ss", False
    )
    tls = parse_sentinel("rediss+sentinel://worker:pw@s1:1/main")
    assert tls == SentinelUrl((("s1", 1),), "main", 0, "worker", "pw", True)
    assert is_tls("rediss+sentinel://s1/main") and not is_tls(STORE)
    assert parse_sentinel("redis://localhost:6379/0") is None


def test_kombu_spelling_takes_its_master_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    kombu = "sentinel://:pw@s1:26380/2;sentinel://s2:26381/2"
    with pytest.raises(ConfigurationError, match=MASTER_ENV):
        parse_sentinel(kombu)
    monkeypatch.setenv(MASTER_ENV, "main")
    assert parse_sentinel(kombu) == SentinelUrl(
        (("s1", 26380), ("s2", 26381)), "main", 2, None, "pw", False
    )


def test_the_store_url_in_kombu_spelling() -> None:
    assert kombu_url(STORE) == (
        "sentinel://:p%40ss@s1:26380/3;sentinel://:p%40ss@s2:26379/3;"
        "sentinel://:p%40ss@[::1]:26382/3"
    )
    assert kombu_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://s1:26379", "name the master"),
        ("redis+sentinel://s1:x/main", "port must be a number"),
        ("redis+sentinel://s1/main/zero", "database must be a number"),
        ("redis+sentinel://s1/main?ssl=1", r"no \?options"),
        ("sentinel://s1;redis://s2", "must be sentinel://"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_naming_the_setting(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as refused:
        check_redis_url("SAGA_REDIS_URL", url)
    assert "SAGA_REDIS_URL=" in str(refused.value)


def test_settings_read_a_sentinel_store_and_a_sentinel_broker_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAGA_REDIS_URL", STORE)
    assert Settings.from_env().redis_url == STORE
    monkeypatch.delenv("SAGA_REDIS_URL")
    monkeypatch.setenv("SAGA_BROKER_URL", "sentinel://s1:26379;sentinel://s2:26379")
    with pytest.raises(ConfigurationError, match=MASTER_ENV):
        Settings.from_env()
    monkeypatch.setenv(MASTER_ENV, "main")
    assert Settings.from_env().redis_url.startswith("sentinel://")
    monkeypatch.setenv("SAGA_REDIS_URL", "rediss+sentinel://s1/main")
    assert Settings.from_env().redis_options["ssl_cert_reqs"] == "required"


def test_kombu_gets_the_master_and_the_sentinels_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kombu = kombu_url(STORE)
    assert sentinel_transport_options(STORE, "redis://h/0") == {}
    assert sentinel_transport_options(STORE, kombu) == {"master_name": "main"}
    monkeypatch.setenv(MASTER_ENV, "other")
    monkeypatch.setenv(PASSWORD_ENV, "sentinels-secret")
    options = sentinel_transport_options(STORE, "redis://h/0", kombu)
    assert options["master_name"] == "other"
    assert options["sentinel_kwargs"]["password"] == "sentinels-secret"


def _celery_defaults(env: dict[str, str]) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    code = (
        "import json, saga.celery_defaults as c; print(json.dumps({k: getattr(c, k) for k in "
        "('broker_url', 'result_backend', 'broker_transport_options', "
        "'result_backend_transport_options', 'broker_use_ssl')}, default=str))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_celery_defaults_follow_a_sentinel_store_or_a_sentinel_broker() -> None:
    # Only the store on Sentinel: the broker and the result backend follow it, master and all.
    found = _celery_defaults({"SAGA_REDIS_URL": "redis+sentinel://s1:1,s2:2/main/4"})
    assert found["broker_url"] == found["result_backend"] == "sentinel://s1:1/4;sentinel://s2:2/4"
    for name in ("broker_transport_options", "result_backend_transport_options"):
        options = found[name]
        assert isinstance(options, dict) and options["master_name"] == "main"
    # Only the broker (kombu's spelling) and the master's name.
    found = _celery_defaults(
        {"SAGA_BROKER_URL": "sentinel://s1:1;sentinel://s2:2", MASTER_ENV: "main"}
    )
    options = found["broker_transport_options"]
    assert isinstance(options, dict) and options["master_name"] == "main"
    assert found["result_backend"] == "sentinel://s1:1;sentinel://s2:2"
    # A plain Redis: nothing of Sentinel's.
    found = _celery_defaults({"SAGA_REDIS_URL": "redis://h:1/0"})
    options = found["broker_transport_options"]
    assert isinstance(options, dict) and "master_name" not in options
    found = _celery_defaults({"SAGA_REDIS_URL": "rediss+sentinel://s1:1/main"})
    assert found["broker_use_ssl"] is not None
