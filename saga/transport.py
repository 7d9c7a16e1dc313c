"""kombu's Redis transport, with one client per channel instead of one per command.

kombu's Redis channel builds a new ``redis.Redis`` around its connection pool for every
publish, ack, unacked-index update and event it sends. With redis-py 8 each of those objects
costs about 0.1 ms of Python (its response callbacks are copied into a fresh case-insensitive
dict), and a saga worker sends several per task: the acks_late bookkeeping, the task events
Flower shows, the ``task-sent`` event and each message a tool or turn publishes. Profiling a
turn worker under load put a fifth of its CPU there. The client object holds no connection of
its own (each command borrows one from the pool, as before) and redis-py clients are safe to
share between threads, so one per channel changes nothing but the cost.

Its connections also raise a Redis failing over (``saga.redis_errors``: NOREPLICAS, READONLY,
MASTERDOWN, UNBLOCKED, ...) as a lost connection. kombu counts every other Redis answer as a
channel error, which the worker's consumer does not recover from: a broker demoted under a
worker, or refusing writes for want of replicas, stopped it ("Unrecoverable error"). As a
connection error, the consumer reconnects with its usual backoff until writes are taken again,
and a publish is retried under its retry policy, as when Redis restarts. (redis-py's Sentinel
connection does the same for READONLY.) A Sentinel broker (``sentinel://``) gets the same from
``SentinelTransport``, whose connections also drop themselves when a read is cut short
(``saga.redis_urls.SentinelConnection``).

``use_pooled_client_transport(app)`` selects it for an app whose broker is Redis, unless the
app names a transport of its own; Saga and the web client call it. It is registered with kombu
as ``saga-redis`` (``saga-rediss`` for TLS): the scheme the worker's "Connected to" line and
Flower show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

from saga.redis_errors import FailoverError, failover_answer
from saga.redis_packer import pack_with_hiredis
from saga.redis_urls import SentinelConnection, SentinelSSLConnection

__all__ = [
    "ALIASES",
    "Channel",
    "FailoverAwareConnection",
    "FailoverAwareSSLConnection",
    "FailoverAwareSentinelConnection",
    "FailoverAwareSentinelSSLConnection",
    "SentinelChannel",
    "SentinelTransport",
    "Transport",
    "use_pooled_client_transport",
]

#: The broker URL's scheme → what ``broker_transport`` is set to (a kombu transport alias).
ALIASES = {"redis": "saga-redis", "rediss": "saga-rediss"}
for _alias in ALIASES.values():
    TRANSPORT_ALIASES.setdefault(_alias, "saga.transport:Transport")
#: kombu's Sentinel transport (``sentinel://``) with this module's connections.
SENTINEL_ALIAS = "saga-sentinel"
TRANSPORT_ALIASES.setdefault(SENTINEL_ALIAS, "saga.transport:SentinelTransport")


def _read(read: Any, *args: Any, **kwargs: Any) -> Any:
    """The answer ``read`` reads; a failover answer as ``FailoverError``, on which redis-py
    and kombu drop the connection (the next command connects anew, to a new master maybe)."""
    try:
        return read(*args, **kwargs)
    except redis.ResponseError as exc:
        if isinstance(exc, FailoverError) or not failover_answer(exc):
            raise
        raise FailoverError(*exc.args, status_code=exc.status_code) from exc


class FailoverAwareConnection(redis.Connection):
    """A connection to the broker that raises a failover answer as ``FailoverError``."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return _read(super().read_response, *args, **kwargs)


class FailoverAwareSSLConnection(redis.SSLConnection):
    """``FailoverAwareConnection`` over TLS."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return _read(super().read_response, *args, **kwargs)


class FailoverAwareSentinelConnection(SentinelConnection):
    """A connection to the master the sentinels name that raises a failover answer as
    ``FailoverError``, and drops itself when a read is cut short (``SentinelConnection``)."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return _read(super().read_response, *args, **kwargs)


class FailoverAwareSentinelSSLConnection(SentinelSSLConnection):
    """``FailoverAwareSentinelConnection`` over TLS."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        return _read(super().read_response, *args, **kwargs)


class _ClosedConnectionGuard:
    """A channel closed after its connection was: a lost connection, not an AttributeError.

    When the broker goes away while a worker waits on its queue (``BRPOP``), Celery's consumer
    first collects the connection (the channel's close fails on the dead socket, and the
    transport is let go), then closes it again. That second close restores the delivered,
    unacknowledged messages through a connection pool the channel has just dropped, and
    building a new one reads the let-go transport's client: ``AttributeError``, which no close
    path ignores, so the worker stopped ("Unrecoverable error") instead of reconnecting. A
    broker restarted empty (the split topology of ``docs/deployment.md``) stopped every such
    worker. Raised as a lost connection, the close is ignored as kombu means it to be, and the
    consumer reconnects; the messages stay in the broker's unacknowledged index, restored once
    their visibility timeout passes (or lost with the broker, and sent again by the reaper)."""

    connection: Any

    def _get_pool(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise redis.ConnectionError("the broker connection is closed")
        return super()._get_pool(asynchronous)  # type: ignore[misc]


class _HiredisPacking:
    """Commands packed by hiredis (``saga.redis_packer``): kombu's too, the same bytes."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        pack_with_hiredis(params)
        return params


class Channel(_HiredisPacking, _ClosedConnectionGuard, kombu_redis.Channel):
    """A Redis channel whose synchronous client is made once per connection pool, and whose
    connections raise a failover answer as a lost connection."""

    connection_class = FailoverAwareConnection
    connection_class_ssl = FailoverAwareSSLConnection
    _shared_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the BRPOP/LISTEN clients are made once already (cached properties)
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        client = self._shared_client
        # kombu drops its pools when the channel closes or reconnects: follow it to the new one.
        if client is None or client.connection_pool is not self.pool:
            client = self._shared_client = super()._create_client()  # type: ignore[no-untyped-call]
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelChannel(_HiredisPacking, _ClosedConnectionGuard, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel whose connections are ``FailoverAwareSentinelConnection``s: a
    failover answer is a lost connection, and a read cut short (a soft time limit in a
    publish) never leaves its reply for the connection's next command."""

    connection_class = FailoverAwareSentinelConnection
    connection_class_ssl = FailoverAwareSentinelSSLConnection  # type: ignore[assignment]


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def use_pooled_client_transport(app: Any) -> None:
    """Use this transport for ``app`` if its broker is Redis and no transport is named."""
    conf = app.conf
    if conf.get("broker_transport"):
        return
    url = conf.get("broker_url") or ""
    scheme = urlparse(url).scheme if isinstance(url, str) else ""
    if scheme in ALIASES:
        conf.broker_transport = ALIASES[scheme]
    elif scheme == "sentinel":
        conf.broker_transport = SENTINEL_ALIAS


def declares_nothing(app: Any, task_name: str) -> bool:
    """Whether a message of ``task_name`` may be published without declaring its queue again.

    Celery declares the queue on every publish; kombu skips the declaration once made on the
    connection, but only after copying the queue entity to bind it, which is a fifth of a
    publish. On this transport, for a task its routes send by name alone to a plain queue on a
    direct exchange, the declaration does nothing the publish needs: Celery publishes such a
    message to the anonymous exchange, which pushes it to the list its routing key names
    without reading any binding, and a plain queue has no expiry to refresh. (The workers
    declare their queues as they start consuming, as before.) Anything else, another broker,
    a routing function, a fanout or topic exchange, a queue with arguments, is declared as
    Celery always does."""
    conf = app.conf
    if conf.get("broker_transport") not in ALIASES.values():
        return False
    routes = conf.get("task_routes") or ()
    routers = routes if isinstance(routes, list | tuple) else [routes]
    if not all(isinstance(router, Mapping) for router in routers):
        return False  # a router function (or its import path) may route by arguments
    queue = app.amqp.router.route({}, task_name, (), {}, None).get("queue")
    if queue is None or isinstance(queue, str):
        return False
    return bool(
        queue.exchange is not None
        and queue.exchange.type == "direct"
        and not queue.queue_arguments
        and not queue.auto_delete
        and queue.expires is None
        and queue.max_priority is None
    )
