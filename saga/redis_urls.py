"""Every Redis client saga opens from a URL: a plain server's, a Sentinel deployment's, or a
Redis Cluster's.

A Sentinel URL names the sentinels and the master's name, never the master's address, so
that the client asks the sentinels where the master is on every new connection and follows a
failover by itself (redis-py's ``Sentinel.master_for``). Two spellings are read:

- ``redis+sentinel://[[user]:password@]host1:port1,host2:port2/<master>[/<db>]``
  (``rediss+sentinel://`` for TLS to the master and to the sentinels): the store's, with the
  master's name in it. The password is the master's (``SAGA_REDIS_PASSWORD`` fills it in).
- ``sentinel://[:password@]host1:port1;sentinel://host2:port2[/<db>]``: kombu's and Celery's,
  which has no room for the master's name: ``SAGA_REDIS_SENTINEL_MASTER`` gives it.

The sentinels' own password (when they have one: ``requirepass`` in sentinel.conf) is
``SAGA_REDIS_SENTINEL_PASSWORD`` (or ``..._FILE``): read here, when a client is made, so that it
never sits in ``Settings.redis_options``, which is logged.

A cluster URL names seed nodes, any of the cluster's (the client learns every slot's master
from them, and follows ``MOVED`` and a failover by itself: redis-py's ``RedisCluster``):

- ``redis+cluster://[[user]:password@]host1:port1,host2:port2[/0]`` (``rediss+cluster://``
  for TLS). A cluster has database 0 only; the password is every node's
  (``SAGA_REDIS_PASSWORD`` fills it in). The store alone may be a cluster: kombu's Redis
  transport has no cluster mode, so the broker is RabbitMQ or a plain or Sentinel Redis.

Why a failover never leaves a write on the demoted master: Sentinel kills every client
connection of the instances it reconfigures, so each connection is opened again, and redis-py's
``SentinelConnectionPool`` asks the sentinels for the master before opening one. An idle
connection to the old address is dropped when a new one learns the new address, one given
back after that is closed rather than pooled (``owns_connection``), and a ``READONLY`` answer
(a connection that outlived the demotion) closes it and is a ``ConnectionError``: the store
says "unavailable" and the caller's retry reaches the new master.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster as cluster
import redis.sentinel as sentinel
from redis.exceptions import RedisClusterException

from saga.env_secrets import secret_from_env
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.redis_packer import pack_with_hiredis

__all__ = [
    "CLUSTER_SCHEMES",
    "ClusterUrl",
    "MASTER_ENV",
    "PASSWORD_ENV",
    "SentinelConnection",
    "SentinelSSLConnection",
    "SentinelUrl",
    "async_client",
    "is_cluster",
    "is_tls",
    "kombu_url",
    "parse_cluster",
    "parse_sentinel",
    "redis_client",
    "sentinel_transport_options",
]

MASTER_ENV = "SAGA_REDIS_SENTINEL_MASTER"
PASSWORD_ENV = "SAGA_REDIS_SENTINEL_PASSWORD"
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
KOMBU_SCHEME = "sentinel"
DEFAULT_SENTINEL_PORT = 26379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_REDIS_PORT = 6379


@dataclass(frozen=True)
class SentinelUrl:
    """What a Sentinel URL says, whichever its spelling."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False

    def kombu(self) -> str:
        """The same deployment as kombu and Celery spell it (the master's name goes in
        their transport options: ``sentinel_transport_options``)."""
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        return ";".join(
            f"sentinel://{auth}{_host(host)}:{port}/{self.db}" for host, port in self.sentinels
        )


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _address(text: str, default: int = DEFAULT_SENTINEL_PORT) -> tuple[str, int]:
    """``host[:port]`` (``[v6]:port`` too), the port ``default`` (Sentinel's) if none."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ConfigurationError(f"an address is empty in {text!r}")
    if port and not port.isdigit():
        raise ConfigurationError(f"the port must be a number, got {port!r}")
    return host, int(port or default)


def _db(text: str) -> int:
    if text and not text.isdigit():
        raise ConfigurationError(f"the database must be a number, got {text!r}")
    return int(text or 0)


def parse_sentinel(url: str, master: str | None = None) -> SentinelUrl | None:
    """The Sentinel deployment ``url`` names, or None when it names a plain Redis.

    ``master`` (else ``SAGA_REDIS_SENTINEL_MASTER``) names the master where the URL does not;
    a ``redis+sentinel://`` URL's own name wins. ``ConfigurationError`` when it is malformed."""
    scheme, sep, rest = url.partition("://")
    master = master or os.environ.get(MASTER_ENV) or None
    if sep and scheme in SENTINEL_SCHEMES:
        if "?" in rest or "#" in rest:
            raise ConfigurationError("a Sentinel URL takes no ?options (use the settings)")
        netloc, _, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        user, _, password = userinfo.partition(":") if at else ("", "", "")
        name, _, db = path.partition("/")
        if not (name or master):
            raise ConfigurationError(
                f"name the master: {scheme}://host:port,.../<master>/<db> (or {MASTER_ENV})"
            )
        return SentinelUrl(
            tuple(_address(host) for host in hosts.split(",")),
            unquote(name) if name else str(master),
            _db(db.strip("/")),
            unquote(user) or None,
            unquote(password) if at and ":" in userinfo else None,
            scheme == "rediss+sentinel",
        )
    if not (sep and scheme == KOMBU_SCHEME):
        return None
    chunks = [urlsplit(chunk) for chunk in url.split(";") if chunk.strip()]
    if any(chunk.scheme != KOMBU_SCHEME for chunk in chunks):
        raise ConfigurationError("every address of a sentinel:// URL must be sentinel://")
    if not master:
        raise ConfigurationError(f"a sentinel:// URL does not name the master: set {MASTER_ENV}")
    first = chunks[0]
    try:
        sentinels = tuple(
            (chunk.hostname or "", chunk.port or DEFAULT_SENTINEL_PORT) for chunk in chunks
        )
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    return SentinelUrl(
        sentinels,
        master,
        _db(first.path.strip("/")),
        unquote(first.username) if first.username else None,
        unquote(first.password) if first.password is not None else None,
    )


@dataclass(frozen=True)
class ClusterUrl:
    """What a cluster URL says: its seed nodes, and the credentials every node takes."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def parse_cluster(url: str) -> ClusterUrl | None:
    """The cluster ``url`` names, or None when it names no cluster. ``ConfigurationError``
    when it is malformed (no node, a port that is no number, a database other than 0)."""
    scheme, sep, rest = url.partition("://")
    if not (sep and scheme.lower() in CLUSTER_SCHEMES):
        return None
    if "?" in rest or "#" in rest:
        raise ConfigurationError("a cluster URL takes no ?options (use the settings)")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    if path.strip("/") not in ("", "0"):
        raise ConfigurationError(
            f"a Redis Cluster has database 0 only, not {path.strip('/')!r}: "
            "give each deployment a cluster (or a key prefix) of its own"
        )
    if not hosts:
        raise ConfigurationError("a cluster URL names no node: redis+cluster://host:port,...")
    return ClusterUrl(
        tuple(_address(host, DEFAULT_REDIS_PORT) for host in hosts.split(",")),
        unquote(user) or None,
        unquote(password) if at and ":" in userinfo else None,
        scheme.lower() == "rediss+cluster",
    )


def is_tls(url: str) -> bool:
    """Whether ``url`` asks for TLS (the certificate settings then apply)."""
    return url.startswith(("rediss://", "rediss+sentinel://", "rediss+cluster://"))


def kombu_url(url: str) -> str:
    """``url`` as kombu and Celery read it: a ``redis+sentinel://`` URL in their
    ``sentinel://`` spelling, any other unchanged."""
    found = parse_sentinel(url) if url.startswith(SENTINEL_SCHEMES) else None
    return found.kombu() if found is not None else url


def _sentinel_password() -> str | None:
    return secret_from_env(PASSWORD_ENV)


def _sentinel_kwargs(options: dict[str, Any], tls: bool) -> dict[str, Any]:
    """How the sentinels are spoken to: the master's socket timeouts (and TLS, when the
    master's is), with the sentinels' own password and never the master's."""
    kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    if tls:
        kwargs |= {k: v for k, v in options.items() if k.startswith("ssl_")}
        kwargs["ssl"] = True
    password = _sentinel_password()
    if password:
        kwargs["password"] = password
    return kwargs


def sentinel_transport_options(store_url: str, *urls: str) -> dict[str, Any]:
    """What kombu's and Celery's Sentinel transports need besides the URL (``master_name``,
    and the sentinels' password), when one of ``urls`` is ``sentinel://``: the master from
    ``SAGA_REDIS_SENTINEL_MASTER``, else the one ``store_url`` names. Empty otherwise."""
    if not any(url.startswith(f"{KOMBU_SCHEME}://") for url in urls):
        return {}
    master = os.environ.get(MASTER_ENV)
    if not master and store_url.startswith(SENTINEL_SCHEMES):
        found = parse_sentinel(store_url)
        master = found.master if found is not None else None
    options: dict[str, Any] = {"master_name": master} if master else {}
    password = _sentinel_password()
    if password:
        options["sentinel_kwargs"] = {"password": password, "socket_timeout": 10.0}
    return options


class _DropOnInterrupt:
    """Sentinel's connection that drops itself when a read is cut short, as a plain one does.

    redis-py's ``SentinelManagedConnection.read_response`` (the sync one) does not disconnect
    on an error by default, unlike ``Connection``'s: an exception raised into a blocked read
    (Celery's soft time limit in a ``WAIT``, a ``KeyboardInterrupt``) gave the connection back
    to the pool with its reply unread, and its next command read that reply as its own (a
    step's check-before-run answered ``0``, ``WAIT``'s count)."""

    def read_response(self, *args: Any, disconnect_on_error: bool = True, **kwargs: Any) -> Any:
        return super().read_response(  # type: ignore[misc]
            *args, disconnect_on_error=disconnect_on_error, **kwargs
        )


# (The mixin's read_response takes what the base's does, spelled as *args/**kwargs.)
class SentinelConnection(_DropOnInterrupt, sentinel.SentinelManagedConnection):  # type: ignore[misc]
    """A connection to the master a Sentinel deployment names (``_DropOnInterrupt``): the
    store's, and the broker's (``saga.transport``)."""


class SentinelSSLConnection(_DropOnInterrupt, sentinel.SentinelManagedSSLConnection):  # type: ignore[misc]
    """``SentinelConnection`` over TLS."""


class _SentinelPool(sentinel.SentinelConnectionPool):
    """Sentinel's pool that, closed for good, closes its connections to the sentinels too
    (redis-py leaves them open with the ``Sentinel`` that made the pool)."""

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        if inuse_connections:  # not a failover's drop of the idle ones: the client closed
            self.sentinel_manager.close()


class _BlockingSentinelPool(_SentinelPool, redis.BlockingConnectionPool):
    """Sentinel's pool that waits for a free connection, as the store's plain pool does."""


class _AsyncSentinelPool(aiosentinel.SentinelConnectionPool):
    """``_SentinelPool`` for asyncio, where an unclosed socket is a ResourceWarning."""

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel_manager.aclose()


class _AsyncBlockingSentinelPool(_AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The asyncio twin of ``_BlockingSentinelPool``."""


def _master_options(found: SentinelUrl, options: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in options.items() if k != "sentinel_kwargs"}
    kwargs |= {"db": found.db, "check_connection": True}
    return _with_credentials(kwargs, found.username, found.password, found.tls)


def _cluster_options(found: ClusterUrl, options: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in options.items() if k not in ("db", "sentinel_kwargs")}
    return _with_credentials(kwargs, found.username, found.password, found.tls)


def _with_credentials(
    kwargs: dict[str, Any], username: str | None, password: str | None, tls: bool
) -> dict[str, Any]:
    """A client's options with the URL's user, password and TLS (a master's, a node's)."""
    if username:
        kwargs["username"] = username
    if password is not None:
        kwargs["password"] = password
    if tls:
        kwargs["ssl"] = True
    return kwargs


def _cluster_client(found: ClusterUrl, blocking: bool, options: dict[str, Any]) -> redis.Redis:
    """A ``RedisCluster`` on ``found``'s seeds: each node's pool waits for a free connection
    when ``blocking``. redis-py runs a pipeline's transaction on a cluster (all of one run's
    keys share a slot) only from 6.1 on."""
    if not hasattr(cluster, "TransactionStrategy"):
        raise ConfigurationError(
            "a Redis Cluster store needs a redis-py whose cluster pipelines run transactions "
            f"(6.1 or newer; installed: {redis.__version__})"
        )
    kwargs = _cluster_options(found, options)
    if blocking:
        kwargs["connection_pool_class"] = redis.BlockingConnectionPool
    seeds = [cluster.ClusterNode(host, port) for host, port in found.nodes]  # type: ignore[no-untyped-call,unused-ignore]
    try:
        client = cluster.RedisCluster(startup_nodes=seeds, **kwargs)
    except (redis.RedisError, RedisClusterException) as exc:
        raise StoreUnavailableError(f"no node of the Redis Cluster answered: {exc}") from exc
    # (RedisCluster speaks redis.Redis's commands; its type is not a subclass.)
    return client  # type: ignore[return-value]


def redis_client(url: str, *, blocking: bool = False, **options: Any) -> redis.Redis:
    """A client of the Redis ``url`` names (the master, for a Sentinel URL; the cluster, for a
    cluster URL). ``blocking``: a pool that waits ``timeout`` seconds for a free connection
    (of ``max_connections``) instead of failing at once."""
    clustered = parse_cluster(url)
    if clustered is not None:
        return _cluster_client(clustered, blocking, options)
    found = parse_sentinel(url)
    if found is None:
        plain = redis.BlockingConnectionPool if blocking else redis.ConnectionPool
        made = plain.from_url(url, **options)
        pack_with_hiredis(made.connection_kwargs)
        return redis.Redis.from_pool(made)
    manager = sentinel.Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
        list(found.sentinels), sentinel_kwargs=_sentinel_kwargs(options, found.tls)
    )
    pool = _BlockingSentinelPool if blocking else _SentinelPool
    connection = SentinelSSLConnection if found.tls else SentinelConnection
    master: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
        found.master,
        connection_pool_class=pool,
        connection_class=connection,
        **_master_options(found, options),
    )
    pack_with_hiredis(master.connection_pool.connection_kwargs)
    return master


def async_client(url: str, *, blocking: bool = False, **options: Any) -> aioredis.Redis:
    """``redis_client`` for asyncio."""
    clustered = parse_cluster(url)
    if clustered is not None:
        kwargs = _cluster_options(clustered, options)
        kwargs.pop("timeout", None)  # (asyncio's cluster pools have no wait of their own)
        seeds = [aiocluster.ClusterNode(host, port) for host, port in clustered.nodes]
        node_client: aioredis.Redis = aiocluster.RedisCluster(  # type: ignore[assignment]
            startup_nodes=seeds, **kwargs
        )
        return node_client
    found = parse_sentinel(url)
    if found is None:
        if blocking:
            return aioredis.Redis.from_pool(
                aioredis.BlockingConnectionPool.from_url(url, **options)
            )
        return aioredis.Redis.from_url(url, **options)
    manager = aiosentinel.Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
        list(found.sentinels), sentinel_kwargs=_sentinel_kwargs(options, found.tls)
    )
    pool = _AsyncBlockingSentinelPool if blocking else _AsyncSentinelPool
    master: aioredis.Redis = manager.master_for(
        found.master, connection_pool_class=pool, **_master_options(found, options)
    )
    return master
