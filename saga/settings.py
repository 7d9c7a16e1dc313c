"""Every setting saga reads, with its default, in one place.

Read once from the environment (``SAGA_*``); pass a ``Settings`` explicitly to override.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self
from urllib.parse import quote, urlsplit, urlunsplit

from saga.constants import IndexLayout
from saga.env_secrets import secret_from_env as secret_from_env
from saga.errors import ConfigurationError
from saga.notify_settings import NotifySettings
from saga.redis_urls import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    is_cluster,
    is_tls,
    parse_cluster,
    parse_sentinel,
)

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def data_dir() -> Path:
    """Where saga keeps its own files when told nothing: one directory per user
    (``$XDG_DATA_HOME/saga``, else ``~/.local/share/saga``), never the current directory, so
    the workers, ``saga serve`` and every ``saga`` command find the same records (and API
    tokens) wherever they are started."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "saga"


def default_database_url() -> str:
    """The records when ``SAGA_DATABASE_URL`` is unset: SQLite in ``data_dir()``."""
    return f"sqlite:///{data_dir() / 'saga.db'}"


def sqlite_file(url: str) -> Path | None:
    """The file a ``sqlite://`` URL names, or None (another database, or one in memory)."""
    scheme, sep, rest = url.partition(":///")
    if not sep or scheme.partition("+")[0] != "sqlite":
        return None
    path = rest.partition("?")[0]
    return None if path in ("", ":memory:") else Path(path)


#: ``scheme://userinfo@`` up to the last ``@``: a password may hold ``/``, ``:`` or ``@``.
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>.*)@")


def masked(url: str) -> str:
    """``url`` fit to print or log: its password (whatever it holds) replaced by ``***``."""
    match = _USERINFO.match(url)
    if match is None:
        return url
    user, colon, _ = match["userinfo"].partition(":")
    shown = f"{user}:***" if colon else "***"
    return f"{match['scheme']}{shown}@{url[match.end() :]}"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0, got {raw!r}")


def with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` in it, percent-encoded (so ``@ : / % #`` survive), unless it
    has one of its own. The user name stays as the URL gives it (``redis://worker@redis``
    logs in as the ACL user ``worker``; none is Redis's ``default`` user)."""
    if not password:
        return url
    parts = urlsplit(url)
    if parts.password is not None or not parts.hostname:
        return url
    user = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def redis_url_from_env(name: str, default: str) -> str:
    """A Redis URL (``SAGA_REDIS_URL``, ``SAGA_BROKER_URL``, ``SAGA_RESULT_BACKEND``) with
    ``SAGA_REDIS_PASSWORD`` (or ``SAGA_REDIS_PASSWORD_FILE``) put in, escaped."""
    url = os.environ.get(name) or default
    return with_password(url, secret_from_env("SAGA_REDIS_PASSWORD"))


def broker_url_from_env(default: str) -> str:
    """``SAGA_BROKER_URL`` (else ``default``) with its password put in, escaped: a RabbitMQ
    URL's from ``SAGA_BROKER_PASSWORD`` (or ``SAGA_BROKER_PASSWORD_FILE``, a container's
    secret), a Redis URL's from ``SAGA_REDIS_PASSWORD`` as the store's. A URL that carries a
    password keeps it."""
    url = os.environ.get("SAGA_BROKER_URL") or default
    name = "SAGA_BROKER_PASSWORD" if is_amqp_url(url) else "SAGA_REDIS_PASSWORD"
    return with_password(url, secret_from_env(name))


_REDIS_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES, "sentinel", *CLUSTER_SCHEMES)
#: RabbitMQ brokers (kombu's py-amqp transport): never the stack's Redis.
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def check_not_cluster(name: str, url: str) -> None:
    """``ConfigurationError`` when the broker's or the results' ``url`` names a Redis
    Cluster: kombu's Redis transport and Celery's Redis backend have no cluster mode."""
    if is_cluster(url):
        raise ConfigurationError(
            f"{name} names a Redis Cluster ({masked(url)!r}), which cannot be Celery's broker "
            "or result backend (kombu and Celery have no cluster mode): the store may be on "
            "the cluster (SAGA_REDIS_URL), and the broker is RabbitMQ (amqp://...), a plain "
            "Redis (redis://...) or a Sentinel deployment (redis+sentinel://...); the results "
            "a plain or Sentinel Redis (docs/deployment.md, 'Redis Cluster')"
        )


def is_amqp_url(url: str) -> bool:
    """Whether ``url`` names a RabbitMQ broker (``amqp://``, ``amqps://``, ``pyamqp://``)."""
    return url.partition("://")[0].lower() in AMQP_SCHEMES


def check_redis_url(name: str, url: str) -> None:
    """``ConfigurationError`` naming ``name`` when ``url`` is not a Redis URL redis-py can
    open: said in one line where it is read, not as a traceback from deep in a connection."""
    shown = masked(url)
    try:
        if parse_sentinel(url) is not None:  # a Sentinel deployment's: checked in full
            return
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}={shown!r} is not a Sentinel URL: {exc}") from None
    try:
        if parse_cluster(url) is not None:  # a cluster's: checked in full
            return
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}={shown!r} is not a Redis Cluster URL: {exc}") from None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise ConfigurationError(f"{name}={shown!r} is not a Redis URL: {exc}") from None
    if parts.scheme not in _REDIS_SCHEMES:
        expected = ", ".join(f"{s}://" for s in _REDIS_SCHEMES)
        raise ConfigurationError(
            f"{name}={shown!r} is not a Redis URL: it must start with {expected}"
        )
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ConfigurationError(f"{name}={shown!r}: the database must be a number, got {db!r}")


def database_url_from_env() -> str:
    """``SAGA_DATABASE_URL`` with ``SAGA_DATABASE_PASSWORD`` (or ``..._FILE``) put in."""
    url = os.environ.get("SAGA_DATABASE_URL") or default_database_url()
    return with_password(url, secret_from_env("SAGA_DATABASE_PASSWORD"))


#: The index shards on a Redis Cluster unless ``SAGA_INDEX_SHARDS`` says otherwise: enough
#: slots to spread the reaper's and the listing's writes over a few dozen masters, few enough
#: that reading every shard (a listing's page, the reaper's pass) stays one short pipeline.
CLUSTER_INDEX_SHARDS = 16


@dataclass(frozen=True)
class Settings:
    #: Redis holding the compensation stacks (workflow state, so never an evicting instance).
    redis_url: str = DEFAULT_REDIS_URL
    #: Where runs and escalations are recorded for people (SQLite file or PostgreSQL).
    database_url: str = field(default_factory=default_database_url)
    #: How long a finished run's Redis keys stay readable.
    retention_seconds: int = 7 * 24 * 3600
    #: Largest JSON argument set, result, undo record or model answer accepted.
    max_payload_bytes: int = 256 * 1024
    #: Largest transcript a hosted run may keep in Redis; past it the run ends (its on_limit).
    max_transcript_bytes: int = 4 * 1024 * 1024
    #: How long ``StepHandle.result()`` and ``Run.finish()`` wait by default.
    wait_timeout: float = 60.0
    #: How long a run may go without progress before the reaper resolves it.
    run_deadline_seconds: int = 900
    #: Deliveries beyond a tool's retry attempts (each one a crash mid-step) before it is
    #: treated as in doubt instead of looping forever under ``task_reject_on_worker_lost``.
    max_redeliveries: int = 2
    #: How long a worker keeps retrying to record a step whose effect happened while the
    #: stack's Redis is unreachable (keep it below the task time limit).
    store_outage_patience: float = 30.0
    #: Whether opening the records database brings its schema to this version's head (every
    #: worker may: it is idempotent and locked). Off, it is only checked, and a database behind
    #: refuses to open: for deployments that run ``saga db upgrade`` as a one-shot step.
    database_auto_upgrade: bool = True
    #: Whether hosted turns (the ``saga.turns`` queue's tasks) send Celery task events, and so
    #: show in Flower. Off by default: a turn is bookkeeping around one model call, whose
    #: progress ``get_run`` and the recorded transcript give in full, and its three events
    #: cost about a fifth of a turn worker's CPU. Tool calls and compensations always send
    #: theirs.
    turn_events: bool = False
    #: Extra Redis client options (e.g. TLS certificates).
    redis_options: dict[str, object] = field(default_factory=dict)
    #: How many replicas must hold the writes a failover must not lose (an undo pushed, a
    #: conclusion, the unwind's owner, a decision, a run's creation: ``saga.store_scripts``)
    #: before they count, and how long each waits for them (``WAIT``; fewer in time is
    #: ``StoreUnavailableError``, waited out like an outage). 0: none, for a single Redis or
    #: a deployment that accepts losing the last writes to a failover. Pair it with
    #: ``min-replicas-to-write`` on the master (``docs/deployment.md``).
    replicas_to_confirm: int = 0
    replica_confirm_timeout_ms: int = 1000
    #: How many ways the cross-run indexes are sharded (``saga.constants.IndexLayout``); 0:
    #: the store's default, 1 on one Redis or Sentinel, ``CLUSTER_INDEX_SHARDS`` on a Redis
    #: Cluster. Every process of a deployment must agree: one that does not refuses to start.
    index_shards: int = 0
    #: How long a person has to answer whether to reverse an effect whose tool asks
    #: (``reversal="ask"``), and how long "later" puts it off: unanswered, the question
    #: expires into an escalation ("a person was asked and did not answer"), never a keep.
    reversal_ask_seconds: int = 24 * 3600
    #: Who is told of escalations besides the ERROR log (``SAGA_NOTIFY_*``).
    notifications: NotifySettings = field(default_factory=NotifySettings)
    #: ``module[:attr]`` of the application's ``Saga`` (``SAGA_APP``): the ``--app`` of the
    #: ``saga`` commands an escalation prints. Empty: found among the imported modules.
    app: str = ""

    def index_layout(self) -> IndexLayout:
        """The cross-run indexes' layout these settings give (``index_shards``)."""
        shards = self.index_shards or (CLUSTER_INDEX_SHARDS if is_cluster(self.redis_url) else 1)
        try:
            return IndexLayout(shards)
        except ValueError as exc:
            raise ConfigurationError(f"SAGA_INDEX_SHARDS: {exc}") from None

    def __repr__(self) -> str:
        """Every setting, the URLs' passwords masked: a Settings is logged and shown."""
        shown = (
            f"{name}={masked(value)!r}" if name.endswith("_url") else f"{name}={value!r}"
            for name, value in vars(self).items()
        )
        return f"Settings({', '.join(shown)})"

    @classmethod
    def from_env(cls) -> Self:
        """Read ``SAGA_REDIS_URL`` (falling back to ``SAGA_BROKER_URL``) and the rest."""
        env = os.environ
        broker_url = env.get("SAGA_BROKER_URL") or DEFAULT_REDIS_URL
        if is_amqp_url(broker_url):  # a RabbitMQ broker: the stack is Redis's, not its
            broker_url = DEFAULT_REDIS_URL
        redis_url = redis_url_from_env("SAGA_REDIS_URL", broker_url)
        check_redis_url(
            "SAGA_REDIS_URL" if env.get("SAGA_REDIS_URL") else "SAGA_BROKER_URL", redis_url
        )
        redis_options: dict[str, object] = {}
        if is_tls(redis_url):
            # Certificates are always checked; the files come from the same variables as the
            # broker's (celeryconfig.py).
            redis_options["ssl_cert_reqs"] = "required"
            for option, name in (
                ("ssl_ca_certs", "SAGA_REDIS_SSL_CA"),
                ("ssl_certfile", "SAGA_REDIS_SSL_CERT"),
                ("ssl_keyfile", "SAGA_REDIS_SSL_KEY"),
            ):
                if env.get(name):
                    redis_options[option] = env[name]
        return cls(
            redis_url=redis_url,
            database_url=database_url_from_env(),
            retention_seconds=_env_int("SAGA_RETENTION_SECONDS", cls.retention_seconds),
            max_payload_bytes=_env_int("SAGA_MAX_PAYLOAD_BYTES", cls.max_payload_bytes),
            max_transcript_bytes=_env_int("SAGA_MAX_TRANSCRIPT_BYTES", cls.max_transcript_bytes),
            wait_timeout=float(_env_int("SAGA_WAIT_TIMEOUT", int(cls.wait_timeout))),
            store_outage_patience=float(
                _env_int("SAGA_STORE_OUTAGE_PATIENCE", int(cls.store_outage_patience))
            ),
            run_deadline_seconds=_env_int("SAGA_RUN_DEADLINE", cls.run_deadline_seconds),
            max_redeliveries=_env_int("SAGA_MAX_REDELIVERIES", cls.max_redeliveries),
            database_auto_upgrade=_env_flag("SAGA_DB_AUTO_UPGRADE", cls.database_auto_upgrade),
            turn_events=_env_flag("SAGA_TURN_EVENTS", cls.turn_events),
            redis_options=redis_options,
            replicas_to_confirm=_env_int("SAGA_REDIS_CONFIRM_REPLICAS", cls.replicas_to_confirm),
            replica_confirm_timeout_ms=_env_int(
                "SAGA_REDIS_CONFIRM_TIMEOUT_MS", cls.replica_confirm_timeout_ms
            ),
            index_shards=_env_int("SAGA_INDEX_SHARDS", cls.index_shards),
            reversal_ask_seconds=_env_int("SAGA_REVERSAL_ASK_SECONDS", cls.reversal_ask_seconds),
            notifications=NotifySettings.from_env(),
            app=env.get("SAGA_APP", "").strip(),
        )
