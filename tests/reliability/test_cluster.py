"""The store on a Redis Cluster: three masters, three replicas, started by the module.

The broker cannot be a cluster (kombu's Redis transport has none), so it is a plain
``redis-server`` of the module's own beside it. A real worker given ``SAGA_REDIS_URL=
redis+cluster://...`` runs the demo's runs; the run's keys live on one master (one hash tag),
its index entries on another (the shards); a master failover at each point of a run
(``CLUSTER FAILOVER``, and a master killed with its replica promoted) ends every run as it
would have ended, each effect and undo applied once, Redis and SQL agreeing.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from saga import Saga, Settings
from saga.aio import AsyncClient
from saga.client import Client
from saga.constants import LOOK_AFTER_EXPIRY, IndexLayout, run_keys
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.guard import lease_failover_problem
from saga.listing import RunFilter, list_runs
from saga.model import RunState
from saga.stack import ReplicaConfirmation, RunStore
from saga.testing import RedisServer, WorkerProcess
from saga.worker import guard_problems
from tasks import systems
from tasks.tools import tools
from tests.conftest import ROOT, service_missing
from tests.integration.helpers import demo_steps, wait_until
from tests.reliability.conftest import TIME_LIMIT, VISIBILITY_TIMEOUT
from tests.reliability.failover_drive import (
    FAILOVER_POINTS,
    confirming,
    faults_on,
    hosted_turn_through_failover,
    run_through_failover,
)
from tests.reliability.redis_cluster import RedisClusterNodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    with RedisClusterNodes(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


#: The caller's time limits, which the unwind's messages carry: those of the confirming
#: worker (``confirming``), so an undo whose record meets a master being killed waits out
#: the promotion (a few seconds past cluster-node-timeout) instead of being cut short.
CALLER_TIME_LIMIT = 15


def _app(broker: RedisServer) -> Celery:
    app = Celery("cluster-test")
    app.config_from_object("celeryconfig")
    options = {"visibility_timeout": 20}
    app.conf.update(
        broker_url=broker.url,
        result_backend=broker.url,
        broker_transport_options=options,
        task_time_limit=CALLER_TIME_LIMIT,
        task_soft_time_limit=CALLER_TIME_LIMIT - 2,
    )
    return app


def demo_env(nodes: RedisClusterNodes, broker: RedisServer, data: Path) -> dict[str, str]:
    """The demo worker's environment: the store on the cluster, the broker (and the results,
    which saga's tasks do not keep) on the plain Redis."""
    return {
        "SAGA_REDIS_URL": nodes.url(),
        "SAGA_BROKER_URL": broker.url,
        "SAGA_DEMO_DATA": str(data),
        "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
        "SAGA_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def world(
    nodes: RedisClusterNodes,
    broker: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Saga, dict[str, str]]]:
    """A saga on the cluster (this process under the worker's environment) and that env."""
    env = demo_env(nodes, broker, tmp_path)
    for key in ("SAGA_RESULT_BACKEND", "SAGA_REDIS_CONFIRM_REPLICAS", "SAGA_INDEX_SHARDS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    systems.reset()
    settings = Settings(redis_url=env["SAGA_REDIS_URL"], database_url=env["SAGA_DATABASE_URL"])
    saga = Saga(_app(broker), tools, settings)
    yield saga, env
    saga.store.client.close()
    if saga.core._records is not None:
        saga.records.dispose()
    systems.dispose_engines()


def _masters_holding(nodes: RedisClusterNodes, keys: list[str]) -> set[int]:
    return {nodes.master_of_key(key) for key in keys}


def test_a_run_lives_on_one_master_and_its_index_entries_on_their_shards(
    nodes: RedisClusterNodes, broker: RedisServer, world: tuple[Saga, dict[str, str]]
) -> None:
    """A whole demo run on a real worker; the run's keys on one master (its hash tag), the
    index shards spread over every master; the sync and asyncio clients list and read it."""
    saga, env = world
    layout = saga.store.layout
    assert layout == IndexLayout(16) and saga.store.clustered
    assert len(_masters_holding(nodes, layout.every("active"))) == 3
    with WorkerProcess("tasks.app", env=env, concurrency=1, cwd=ROOT) as worker:
        run = saga.start_run()
        assert len(demo_steps(run)) == 4
        assert run.finish(timeout=30).state is RunState.COMPLETED
        del worker
    assert len(_masters_holding(nodes, run_keys(run.run_id))) == 1
    on_broker = redis.Redis.from_url(broker.url)
    try:  # the messages went through the plain Redis (kombu's bindings are there)
        assert on_broker.exists("_kombu.binding.celery")
    finally:
        on_broker.close()
    store = saga.store
    assert store.client.zscore(layout.created_of(run.run_id), run.run_id) is not None
    assert run.run_id in store.active_runs()
    # recorded: the reaper looks again once the keys have expired (an entry on another master)
    # (the worker's estimate of the servers' clock, read here exactly: they may differ by a
    # fraction of a ms, hence the second's slack)
    expired = store.now(exact=True) + store.retention_seconds + LOOK_AFTER_EXPIRY
    assert expired - 30 <= (store.due_at(run.run_id) or 0) <= expired + 1
    assert run.run_id in [r.run_id for r in list_runs(store, None, RunFilter(limit=20))]
    # A hosted run (its turn stays queued: no turn worker) in the clients' listings.
    client = Client(redis_url=nodes.url(), settings=saga.settings)
    try:
        hosted = client.enqueue_run("refund", "Refund order 4921.")
        assert hosted in [r.run_id for r in client.list_runs(limit=20)]
        assert client.get_run(run.run_id).state == "completed"

        async def listed() -> list[str]:
            async with AsyncClient(redis_url=nodes.url(), settings=saga.settings) as aio:
                return [r.run_id for r in await aio.list_runs(limit=20)]

        assert hosted in asyncio.run(listed())
        client.abort_run(hosted, "not driven by this test")
    finally:
        client.store.client.close()


def test_a_process_sharding_otherwise_refuses_until_the_indexes_are_resharded(
    nodes: RedisClusterNodes, world: tuple[Saga, dict[str, str]]
) -> None:
    """The store records its shard count; a store opened with another refuses (never writes
    where no one reads); ``reshard`` moves every entry, after which the listing and the
    reaper's index find every run again, and the old count is refused in turn."""
    saga, _ = world
    runs = [saga.start_run() for _ in range(5)]
    other = RunStore.from_url(nodes.url(), 60, layout=IndexLayout(4))
    try:
        with pytest.raises(ConfigurationError, match="sharded 16 way"):
            other.create("refused-run", 60.0)
        assert other.client.exists(run_keys("refused-run")[0]) == 0  # nothing written
        moved = other.reshard(IndexLayout(4))
        assert moved["created"] >= 5 and moved["active"] >= 5
        active = set(other.active_runs())
        listed = {run_id for run_id, _ in other.newest("+inf", "-inf", 1000)}
        assert {r.run_id for r in runs} <= active & listed
        with pytest.raises(ConfigurationError, match="sharded 4 way"):
            saga.store.check_layout(force=True)
        other.reshard(IndexLayout(16))  # back, for the module's other tests
        saga.store.check_layout(force=True)
        assert {r.run_id for r in runs} <= set(saga.store.active_runs())
    finally:
        other.client.close()
    for run in runs:
        run.abort("not driven by this test")


#: ``FAILOVER_POINTS`` by ``CLUSTER FAILOVER`` of the run's master, and mid-step and during the
#: unwind also by that master killed (its replica promoted).
CLUSTER_POINTS = {
    **{name: (*where, "failover") for name, where in FAILOVER_POINTS.items()},
    "mid-step-master-killed": (*FAILOVER_POINTS["mid-step"], "kill"),
    "during-the-unwind-master-killed": (*FAILOVER_POINTS["during-the-unwind"], "kill"),
}


def _fail_over(nodes: RedisClusterNodes, run_id: str, how: str) -> None:
    """Fail over the master holding ``run_id``'s keys; a killed one is brought back (as a
    replica of its successor) so the writes that count can be confirmed again."""
    master = nodes.master_of_key(run_keys(run_id)[0])
    if how == "failover":
        nodes.failover(master)
        return
    nodes.kill_master(master)
    nodes.restart(master)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", list(CLUSTER_POINTS))
def test_a_master_failover_with_replica_confirmation_loses_nothing_and_applies_nothing_twice(
    nodes: RedisClusterNodes,
    world: tuple[Saga, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    saga, env = world
    faults = faults_on(saga, monkeypatch)
    worker = WorkerProcess(
        "tasks.app", env=confirming(env), concurrency=1, cwd=ROOT, logfile=tmp_path / "worker.log"
    )
    tool, at, how = CLUSTER_POINTS[point]
    with worker:
        run_through_failover(saga, faults, tool, at, lambda run_id: _fail_over(nodes, run_id, how))


@pytest.mark.timeout(300)
def test_a_master_failover_during_a_hosted_turn_dispatches_each_call_once(
    nodes: RedisClusterNodes,
    world: tuple[Saga, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CLUSTER FAILOVER`` of the run's master while a hosted turn dispatches its three
    calls (paused after the first): each call dispatched and applied once, the model asked
    once a turn, the run completed in Redis and in SQL."""
    saga, env = world
    faults = faults_on(saga, monkeypatch)
    client = Client(redis_url=nodes.url(), broker_url=env["SAGA_BROKER_URL"])
    try:
        hosted_turn_through_failover(
            saga,
            env,
            faults,
            tmp_path,
            client,
            lambda run_id: _fail_over(nodes, run_id, "failover"),
        )
    finally:
        client.store.client.close()


def _runs_on(nodes: RedisClusterNodes, master: int, prefix: str, count: int) -> list[str]:
    """``count`` run ids whose keys are on the master on port ``master``."""
    names = (f"{prefix}-{i}" for i in range(1000))
    return [n for n in names if nodes.master_of_key(run_keys(n)[0]) == master][:count]


def test_a_promoted_master_the_client_still_calls_a_replica_is_given_the_scripts_it_lacks(
    nodes: RedisClusterNodes, world: tuple[Saga, dict[str, str]]
) -> None:
    """Right after a failover the promoted master holds none of saga's scripts (Redis
    replicates none), and the client's map may still call it a replica (a topology read from
    a node that had not heard of the promotion). redis-py loads a missing script on the
    masters it knows of, which missed it: a worker's record of a step raised ``NoScriptError``
    and its run hung. The store loads it on every node it knows of and goes on, for a script
    alone, a pipelined script and the asyncio client's."""
    saga, _ = world
    master = nodes.master_ports()[0]
    first, second, third = _runs_on(nodes, master, "stale-map", 3)
    admin = redis.Redis(port=master)
    store = RunStore.from_url(nodes.url(), 60, layout=saga.store.layout)

    def lose_the_scripts(cluster: Any) -> None:
        admin.script_flush()
        cluster.get_node(host="127.0.0.1", port=master).server_type = "replica"

    try:
        assert store.create(first, 60.0)
        lose_the_scripts(store.client)
        assert store.abort(first, "stale map").status == "ok"  # one script, by its SHA
        lose_the_scripts(store.client)
        assert store.create(second, 60.0)  # the pipelined create

        async def main() -> None:
            async with AsyncClient(redis_url=nodes.url(), settings=saga.settings) as aio:
                await aio._store.redis.initialize()  # type: ignore[union-attr]
                lose_the_scripts(aio._store.redis)
                assert await aio._store.create(third, 60.0, "refund", "stale map", False)
                lose_the_scripts(aio._store.redis)
                assert await aio.abort_run(third, "stale map")

        asyncio.run(main())
    finally:
        for run_id in (first, second, third):  # nothing left for the reaper
            store.client.delete(*run_keys(run_id))
            store.forget(run_id)
        store.client.close()
        admin.close()


def test_a_run_is_indexed_before_its_keys_exist_though_they_live_on_two_masters(
    nodes: RedisClusterNodes, world: tuple[Saga, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster the run's index shard and its keys are on different masters, where one
    pipeline keeps no order: the indexes go first, in a round trip of their own. A creation cut
    short after it leaves entries without keys (which the reaper drops), never keys without
    entries (a run the reaper would never look at)."""
    saga, _ = world
    store = saga.store
    run_id = next(  # one whose index shard and keys are on two masters
        name
        for name in (f"cut-short-{i}" for i in range(100))
        if nodes.master_of_key(store.layout.active_of(name))
        != nodes.master_of_key(run_keys(name)[0])
    )

    def cut_short(*_: Any, **__: Any) -> Any:
        raise StoreUnavailableError("the run's master went away (injected)")

    monkeypatch.setattr(store, "_pipelined", cut_short)
    with pytest.raises(StoreUnavailableError):
        store.create(run_id, 60.0)
    monkeypatch.undo()
    assert store.due_at(run_id) is not None
    assert store.client.zscore(store.layout.created_of(run_id), run_id) is not None
    assert store.client.exists(run_keys(run_id)[0]) == 0
    store.forget(run_id)  # what the reaper does with an entry whose keys are not there
    assert store.due_at(run_id) is None


def test_a_new_runs_index_entries_are_confirmed_on_their_own_master(
    nodes: RedisClusterNodes, world: tuple[Saga, dict[str, str]]
) -> None:
    """With replica confirmation, a run's creation counts only once its index entries are on
    a replica too: on a cluster they are on another master than the run's keys, whose replica
    a ``WAIT`` on the run's master says nothing of. That replica paused: the creation is
    ``StoreUnavailableError`` (the run's own master confirmed, the index's did not)."""
    saga, _ = world
    layout = saga.store.layout
    run_id = next(
        name
        for name in (f"confirmed-index-{i}" for i in range(100))
        if nodes.master_of_key(layout.active_of(name)) != nodes.master_of_key(run_keys(name)[0])
    )
    replica = nodes.server(nodes.replica_of(nodes.master_of_key(layout.active_of(run_id))))
    assert replica.process is not None
    strict = RunStore.from_url(
        nodes.url(), 60, confirmation=ReplicaConfirmation(1, 500), layout=layout
    )
    try:
        os.kill(replica.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailableError, match="create was confirmed by 0 of 1"):
                strict.create(run_id, 60.0)
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        assert strict.due_at(run_id) is not None  # it stands on the master, unconfirmed
        wait_until(lambda: _created_again(strict, run_id), 20, "the replica to catch up")
    finally:
        strict.client.delete(*run_keys(run_id))
        strict.forget(run_id)
        strict.client.close()


def _created_again(store: RunStore, run_id: str) -> bool:
    """The same creation again converges (the run exists) and is confirmed now."""
    try:
        store.create(run_id, 60.0)
    except StoreUnavailableError:
        return False
    return True


def test_the_start_up_guard_reads_every_master_of_the_cluster(
    nodes: RedisClusterNodes, world: tuple[Saga, dict[str, str]]
) -> None:
    """The guard's checks of the servers' own settings read each master (an evicting one
    refuses the worker), and the failover-outlasts-the-lease warning reads the cluster's
    ``cluster-node-timeout`` as it reads Sentinel's ``down-after-milliseconds``."""
    saga, _ = world
    assert guard_problems(saga.core) == []
    assert lease_failover_problem(saga.core) is None  # 2 s: shorter than the lease
    last = saga.store.servers()[-1]
    try:
        last.config_set("maxmemory-policy", "allkeys-lru")
        for server in saga.store.servers():
            server.config_set("cluster-node-timeout", 60000)
        assert any("allkeys-lru" in problem for problem in guard_problems(saga.core))
        problem = lease_failover_problem(saga.core)
        assert problem is not None and "cluster-node-timeout (60 s)" in problem
    finally:
        last.config_set("maxmemory-policy", "noeviction")
        for server in saga.store.servers():
            server.config_set("cluster-node-timeout", 2000)
