"""Redis Cluster URLs and the sharded indexes' layout: a cluster URL read (seeds, credentials,
TLS), refused where it cannot work (a database other than 0, options, no node; as the broker
or the results), the results' default where the store is a cluster, and where each run's index
entries go."""

from __future__ import annotations

import subprocess
import sys

import pytest
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from saga.constants import (
    ACTIVE_RUNS_KEY,
    AWAITING_APPROVAL_KEY,
    CREATED_RUNS_KEY,
    IndexLayout,
    confirm_probe_key,
)
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.redis_errors import unavailable
from saga.redis_urls import ClusterUrl, is_cluster, is_tls, parse_cluster
from saga.settings import CLUSTER_INDEX_SHARDS, Settings, check_not_cluster, check_redis_url
from saga.stack import reachable
from tests.unit.test_redis_urls import _celery_defaults

CLUSTER = "redis+cluster://:p%40ss@n1:7000,n2,[::1]:7002"


def test_a_cluster_url_names_its_seeds_and_credentials() -> None:
    assert parse_cluster(CLUSTER) == ClusterUrl(
        (("n1", 7000), ("n2", 6379), ("::1", 7002)), None, "p@ss", False
    )
    assert parse_cluster("rediss+cluster://worker:pw@n1:1/0") == ClusterUrl(
        (("n1", 1),), "worker", "pw", True
    )
    assert parse_cluster("redis+cluster://[::1]") == ClusterUrl((("::1", 6379),))
    assert is_cluster(CLUSTER) and is_tls("rediss+cluster://n1:1")
    assert parse_cluster("redis://n1:1/0") is None and not is_cluster("redis://n1:1/0")
    check_redis_url("SAGA_REDIS_URL", CLUSTER)  # accepted where the store's URL is read


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://n1:1/3", "database 0 only"),
        ("redis+cluster://n1:1?max_connections=3", "takes no"),
        ("redis+cluster:///", "names no node"),
        ("redis+cluster://n1:port", "must be a number"),
    ],
)
def test_a_malformed_cluster_url_is_refused_naming_the_setting(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=r"SAGA_REDIS_URL=.*is not a Redis Cluster URL"):
        check_redis_url("SAGA_REDIS_URL", url)
    with pytest.raises(ConfigurationError, match=says):
        parse_cluster(url)


def test_the_index_layout_is_one_unsharded_shard_unless_the_store_is_a_cluster() -> None:
    assert Settings(redis_url="redis://h:1/0").index_layout() == IndexLayout(1)
    assert Settings(redis_url=CLUSTER).index_layout() == IndexLayout(CLUSTER_INDEX_SHARDS)
    assert Settings(redis_url="redis://h:1/0", index_shards=4).index_layout() == IndexLayout(4)
    with pytest.raises(ConfigurationError, match="SAGA_INDEX_SHARDS"):
        Settings(index_shards=2000).index_layout()


def test_one_shard_is_the_unsharded_keys_and_more_spread_runs_over_tagged_keys() -> None:
    one = IndexLayout(1)
    assert (one.active_of("r"), one.created_of("r"), one.awaiting_of("r")) == (
        ACTIVE_RUNS_KEY,
        CREATED_RUNS_KEY,
        AWAITING_APPROVAL_KEY,
    )
    sixteen = IndexLayout(16)
    runs = [f"run-{i}" for i in range(400)]
    shards = {sixteen.shard_of(r) for r in runs}
    assert shards == set(range(16))  # every shard takes some
    run = runs[0]
    shard = sixteen.shard_of(run)
    assert sixteen.shard_of(run) == shard  # stable: crc32, not Python's salted hash
    tag = f"{{ix-{shard}}}"
    assert all(tag in key for key in (sixteen.active_of(run), sixteen.created_of(run)))
    assert len(sixteen.every("active")) == 16 and len(set(sixteen.every("created"))) == 16


def test_a_cluster_is_refused_as_the_broker_or_the_results_naming_what_works() -> None:
    with pytest.raises(ConfigurationError, match=r"RabbitMQ.*plain\s+Redis.*Sentinel"):
        check_not_cluster("SAGA_BROKER_URL", CLUSTER)
    check_not_cluster("SAGA_BROKER_URL", "redis://h:1/0")
    code = "import saga.celery_defaults"
    for env in ({"SAGA_REDIS_URL": CLUSTER}, {"SAGA_BROKER_URL": CLUSTER}):
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode != 0
        assert "cannot be Celery's broker" in done.stderr and "p@ss" not in done.stderr


def test_the_results_follow_the_broker_beside_a_cluster_store() -> None:
    on_redis = _celery_defaults({"SAGA_REDIS_URL": CLUSTER, "SAGA_BROKER_URL": "redis://b:1/2"})
    assert on_redis["broker_url"] == on_redis["result_backend"] == "redis://b:1/2"
    on_rabbit = _celery_defaults(
        {"SAGA_REDIS_URL": CLUSTER, "SAGA_BROKER_URL": "amqp://guest@rabbit:5672/saga"}
    )
    assert on_rabbit["result_backend"] == "rpc://"


@pytest.mark.parametrize(
    "error",
    [
        ClusterDownError("CLUSTERDOWN The cluster is down"),
        TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        MovedError("3999 127.0.0.1:6381"),
        AskError("3999 127.0.0.1:6381"),
        ClusterError("TTL exhausted."),
        SlotNotCoveredError("Command # 1 (EVALSHA) has no node for slot 3999"),
        ResponseError("Command # 1 (EVALSHA ...) of pipeline caused error: CLUSTERDOWN ..."),
    ],
)
def test_a_cluster_failing_over_is_the_store_unavailable(error: Exception) -> None:
    """What a cluster answers while a master fails over or a slot moves, once the client's
    own redirections and retries are spent: the store is away, waited out, never a traceback."""
    assert unavailable(error)
    with pytest.raises(StoreUnavailableError), reachable("test"):
        raise error


def test_the_confirmation_probe_lands_in_the_slot_of_the_key_it_confirms() -> None:
    layout = IndexLayout(16)
    for key in (
        "saga:{run-1}:run",
        layout.active_of("run-1"),
        ACTIVE_RUNS_KEY,
        CREATED_RUNS_KEY,
    ):
        assert key_slot(confirm_probe_key(key).encode()) == key_slot(key.encode())
    assert confirm_probe_key("saga:{run-1}:run") == "saga:{run-1}:confirm"
