"""The broker transport that reuses one Redis client per channel (against a real Redis)."""

from __future__ import annotations

import uuid

import redis
from celery import Celery

from saga.transport import Channel, Transport, use_pooled_client_transport


def test_a_redis_broker_gets_the_pooled_client_transport(redis_url: str) -> None:
    app = Celery("t", broker=redis_url, set_as_current=False)
    use_pooled_client_transport(app)
    assert app.conf.broker_transport == "saga-redis"
    with app.connection_for_write() as connection:
        assert connection.as_uri().startswith("saga-redis://")
        assert isinstance(connection.transport, Transport)
        assert isinstance(connection.default_channel, Channel)


def test_other_brokers_and_named_transports_are_left_alone() -> None:
    amqp = Celery("t", broker="amqp://guest@localhost//", set_as_current=False)
    use_pooled_client_transport(amqp)
    assert not amqp.conf.broker_transport
    named = Celery("t", broker="redis://localhost:6379/0", set_as_current=False)
    named.conf.broker_transport = "redis"
    use_pooled_client_transport(named)
    assert named.conf.broker_transport == "redis"


def test_the_channel_reuses_its_client_and_follows_a_new_pool(redis_url: str) -> None:
    app = Celery("t", broker=redis_url, set_as_current=False)
    use_pooled_client_transport(app)
    queue = f"saga-test-transport-{uuid.uuid4().hex}"
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        # The asynchronous (BRPOP) clients are kombu's own, untouched.
        assert channel._create_client(asynchronous=True) is not first
        with connection.SimpleQueue(queue) as simple:
            simple.put({"n": 1})
            simple.put({"n": 2})
            got = simple.get(timeout=5)
            got.ack()
            assert got.payload == {"n": 1}
            channel._pool = None  # what kombu does when it drops its pools on a reconnect
            moved = channel._create_client()
            assert moved is not first
            assert moved.connection_pool is channel.pool
            got = simple.get(timeout=5)
            got.ack()
            assert got.payload == {"n": 2}
        redis.Redis.from_url(redis_url).delete(queue)
