"""The broker transport that reuses one Redis client per channel (against a real Redis)."""

from __future__ import annotations

import uuid

import redis
from celery import Celery
from kombu import Exchange, Queue

from saga.transport import Channel, Transport, declares_nothing, use_pooled_client_transport


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


def _app(broker: str, **conf: object) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(conf)
    use_pooled_client_transport(app)
    return app


def test_a_task_routed_by_name_to_a_plain_direct_queue_needs_no_declaration() -> None:
    # Given the default queue, and a route by name to another plain direct queue
    app = _app("redis://localhost:6379/0", task_routes={"saga.agent_turn": {"queue": "turns"}})
    # Then neither needs its queue declared again on every publish
    assert declares_nothing(app, "tools.issue_credit")
    assert declares_nothing(app, "saga.agent_turn")


def test_anything_else_is_declared_as_celery_always_does() -> None:
    # Another broker: a direct queue must exist before a message reaches it
    assert not declares_nothing(_app("amqp://guest@localhost//"), "tools.x")
    # kombu's own Redis transport, named by the app
    assert not declares_nothing(_app("redis://localhost/0", broker_transport="redis"), "tools.x")
    # A routing function may route by arguments
    router = _app("redis://localhost/0", task_routes=(lambda *_a, **_k: {"queue": "q"},))
    assert not declares_nothing(router, "tools.x")
    # A topic exchange reads its bindings; a queue with arguments (an expiry) refreshes them
    topic = Queue("t", Exchange("t", type="topic"), routing_key="tools.#")
    expiring = Queue("e", Exchange("e"), routing_key="e", expires=60)
    app = _app("redis://localhost/0", task_queues=[topic, expiring])
    app.conf.task_routes = {"tools.x": {"queue": "t"}, "tools.y": {"queue": "e"}}
    assert not declares_nothing(app, "tools.x")
    assert not declares_nothing(app, "tools.y")
