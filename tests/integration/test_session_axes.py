"""The session's worker and app run on the broker and store the matrix gave them
(``SAGA_TEST_BROKER``, ``SAGA_TEST_STORE``; ``tests/conftest.py``): a matrix leg that fell
back to the default Redis would pass every other test and prove nothing."""

from __future__ import annotations

from typing import Any

import redis.cluster
import redis.sentinel

from tests.conftest import TEST_BROKER, TEST_STORE
from tests.integration.helpers import ORDER, wait_until


def test_the_worker_and_the_store_are_on_the_broker_and_store_of_the_matrix(
    saga: Any, worker: Any, demo_app: Any
) -> None:
    run = saga.start_run()
    assert run.call("get_order", order_id=ORDER).result(timeout=30)["order_id"] == ORDER
    assert run.finish(timeout=30).state.value == "completed"

    broker = str(demo_app.app.conf.broker_url)
    wait_until(lambda: "Connected to " in worker.log(), what="the worker's broker line")
    connected = next(ln for ln in worker.log().splitlines() if "Connected to " in ln)
    on_cluster = isinstance(saga.store.client, redis.cluster.RedisCluster)
    on_sentinel = not on_cluster and isinstance(
        saga.store.client.connection_pool, redis.sentinel.SentinelConnectionPool
    )
    if TEST_BROKER == "amqp":
        assert broker.startswith("amqp://") and "Connected to amqp://" in connected
    else:
        assert broker.startswith(("redis://", "sentinel://", "saga-")), broker
        assert "Connected to amqp://" not in connected
    assert on_sentinel is (TEST_STORE == "sentinel")
    assert on_cluster is (TEST_STORE == "cluster")
    if on_cluster:  # three masters, the run's keys on the one serving their slot
        masters = saga.store.client.get_primaries()
        assert len(masters) == 3
        node = saga.store.client.get_node_from_key(f"saga:{{{run.run_id}}}:run")
        assert node.redis_connection.exists(f"saga:{{{run.run_id}}}:run")
