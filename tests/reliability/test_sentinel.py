"""The store and the broker on Redis Sentinel: a master, a replica and three sentinels.

The store, ``Client`` and ``AsyncClient`` find the master through the sentinels; a real worker
given nothing but ``SAGA_REDIS_URL=redis+sentinel://...`` (its broker and result backend
follow it) runs a whole demo run; after ``SENTINEL FAILOVER`` the store and the worker follow
the new master, the next run completes, and the demoted master (a replica now) holds nothing
the old clients wrote to it: every key written after the failover is on the new master.
"""

from __future__ import annotations

import asyncio
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
from saga.constants import run_keys
from saga.guard import configuration_problems, lease_failover_problem
from saga.model import RunState
from saga.redis_urls import kombu_url, redis_client
from saga.stack import RunStore
from saga.testing import WorkerProcess
from saga.transport import SentinelChannel, use_pooled_client_transport
from tasks import systems
from tasks.tools import tools
from tests.conftest import ROOT, service_missing
from tests.integration.helpers import demo_steps
from tests.reliability.conftest import TIME_LIMIT, VISIBILITY_TIMEOUT
from tests.reliability.failover_drive import (
    FAILOVER_POINTS,
    confirming,
    faults_on,
    hosted_turn_through_failover,
    run_through_failover,
)
from tests.reliability.sentinel_cluster import MASTER, SentinelCluster, role


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    with SentinelCluster(tmp_path_factory.mktemp("sentinel")) as running:
        yield running


def _app(cluster: SentinelCluster) -> Celery:
    """The caller's app, on the sentinels as kombu spells them."""
    app = Celery("sentinel-test")
    app.config_from_object("celeryconfig")
    options = {"visibility_timeout": VISIBILITY_TIMEOUT, "master_name": MASTER}
    app.conf.update(
        broker_url=cluster.kombu_url(),
        result_backend=cluster.kombu_url(),
        broker_transport_options=options,
        result_backend_transport_options=options,
        task_time_limit=TIME_LIMIT,
        task_soft_time_limit=TIME_LIMIT - 1,
    )
    return app


def demo_env(cluster: SentinelCluster, data: Path, **extra: str) -> dict[str, str]:
    """The demo worker's environment on the cluster: only the store's URL names Sentinel (no
    broker, no result backend, no master setting)."""
    return {
        "SAGA_REDIS_URL": cluster.url(),
        "SAGA_DEMO_DATA": str(data),
        "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
        "SAGA_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        "SAGA_TASK_TIME_LIMIT": str(TIME_LIMIT),
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def demo_saga(
    cluster: SentinelCluster, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> Saga:
    """A saga on the cluster, this process under ``env`` (and nothing that would override it:
    a broker, a result backend, a master's name, replica confirmation)."""
    for key in (
        "SAGA_BROKER_URL",
        "SAGA_RESULT_BACKEND",
        "SAGA_REDIS_SENTINEL_MASTER",
        "SAGA_REDIS_CONFIRM_REPLICAS",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    systems.reset()
    chosen = Settings(
        redis_url=env["SAGA_REDIS_URL"], database_url=env["SAGA_DATABASE_URL"], **settings
    )
    return Saga(_app(cluster), tools, chosen)


@pytest.fixture
def world(
    cluster: SentinelCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Saga, dict[str, str]]]:
    """A saga on the cluster and the environment of its worker (``demo_env``)."""
    env = demo_env(cluster, tmp_path)
    saga = demo_saga(cluster, env, monkeypatch)
    yield saga, env
    saga.store.client.close()
    if saga.core._records is not None:
        saga.records.dispose()
    systems.dispose_engines()


def _served_by(client: redis.Redis) -> int:
    return int(client.info("server")["tcp_port"])


def test_the_store_and_both_clients_reach_the_master_through_the_sentinels(
    cluster: SentinelCluster, world: tuple[Saga, dict[str, str]]
) -> None:
    saga, _ = world
    url = cluster.url()
    store = RunStore.from_url(url, 60, socket_timeout=5)
    try:
        assert _served_by(store.client) == cluster.master_port()
        assert store.now() > 0
        # The guard's Redis checks ask the master (noeviction: nothing to refuse).
        assert configuration_problems(saga.app.conf, {}, [store.client]) == []
    finally:
        store.client.close()
    run = saga.start_run()
    run.call("get_order", order_id=4921)  # queued, no worker yet: the store holds the run
    settings = saga.settings
    client = Client(redis_url=url, settings=settings)
    assert client.app.conf.broker_url == kombu_url(url)
    assert client.app.conf.broker_transport_options["master_name"] == MASTER
    assert client.get_run(run.run_id).state == RunState.RUNNING

    async def read() -> Any:
        async with AsyncClient(redis_url=url, settings=settings) as aio:
            return (await aio.get_run(run.run_id)).state

    assert asyncio.run(read()) == RunState.RUNNING
    assert client.abort_run(run.run_id, "not driven by this test")
    client.store.client.close()


def test_a_demo_run_completes_and_the_next_one_after_a_failover_too(
    cluster: SentinelCluster, world: tuple[Saga, dict[str, str]], tmp_path: Path
) -> None:
    saga, env = world
    worker = WorkerProcess(
        "tasks.app", env=env, concurrency=1, cwd=ROOT, logfile=tmp_path / "worker.log"
    )
    with worker:
        first = saga.start_run()
        assert len(demo_steps(first)) == 4
        assert first.finish(timeout=30).state is RunState.COMPLETED
        assert "sentinel://" in worker.log()  # its broker came from the store's URL

        old = cluster.master_port()
        new = cluster.failover()
        assert role(old) == "slave" and role(new) == "master"

        systems.reset()
        second = saga.start_run()
        assert len(demo_steps(second)) == 4
        assert second.finish(timeout=60).state is RunState.COMPLETED
    assert _served_by(saga.store.client) == new
    head = run_keys(second.run_id)[0]
    on_new = redis.Redis(port=new, socket_timeout=2)
    on_old = redis.Redis(port=old, socket_timeout=2)
    try:
        assert on_new.exists(head)
        info = on_old.info("replication")
        assert info["role"] == "slave" and int(info["master_port"]) == new
        assert on_old.config_get("replica-read-only")["replica-read-only"] == "yes"
        with pytest.raises(redis.ReadOnlyError):  # what any straggling write would meet
            on_old.set("saga:sentinel-test", "1")
    finally:
        on_new.close()
        on_old.close()


def test_the_guard_warns_when_a_failover_may_outlast_a_turns_asking_lease(
    cluster: SentinelCluster, world: tuple[Saga, dict[str, str]]
) -> None:
    """The sentinels' ``down-after-milliseconds`` (1 s here) plus a failover's election is
    shorter than the turn's lease (the tests' time limit plus the margin): no warning. At
    10 s, longer than that lease, the worker's start-up names both and what to change."""
    saga, _ = world
    assert lease_failover_problem(saga.core) is None
    sentinels = [cluster.sentinel(port) for port in cluster.sentinel_ports]
    try:
        for sentinel in sentinels:
            sentinel.execute_command("SENTINEL", "SET", MASTER, "down-after-milliseconds", 10000)
        problem = lease_failover_problem(saga.core)
        assert problem is not None
        assert (
            "down-after-milliseconds (10 s)" in problem
            and "asked a second time only by its asker" in problem
        )
    finally:
        for sentinel in sentinels:
            sentinel.execute_command("SENTINEL", "SET", MASTER, "down-after-milliseconds", 1000)
            sentinel.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", list(FAILOVER_POINTS))
def test_a_failover_with_replica_confirmation_loses_nothing_and_applies_nothing_twice(
    cluster: SentinelCluster,
    world: tuple[Saga, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """``SENTINEL FAILOVER`` at each point of a run (``FAILOVER_POINTS``), under a worker that
    confirms its writes with the replica (``run_through_failover`` says what must hold)."""
    saga, env = world
    faults = faults_on(saga, monkeypatch)
    worker = WorkerProcess(
        "tasks.app", env=confirming(env), concurrency=1, cwd=ROOT, logfile=tmp_path / "worker.log"
    )
    tool, at = FAILOVER_POINTS[point]
    with worker:
        run_through_failover(saga, faults, tool, at, lambda _: cluster.failover())
    assert _served_by(saga.store.client) == cluster.master_port()


@pytest.mark.timeout(240)
def test_a_failover_during_a_hosted_turn_dispatches_each_call_once_and_asks_the_model_once(
    cluster: SentinelCluster,
    world: tuple[Saga, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``SENTINEL FAILOVER`` while a hosted turn dispatches its three calls (paused after the
    first): the turn plays on against the new master, each call dispatched and applied once,
    the model asked once a turn, and the run completes in Redis and in SQL."""
    saga, env = world
    faults = faults_on(saga, monkeypatch)
    client = Client(redis_url=cluster.url())
    try:
        hosted_turn_through_failover(
            saga, env, faults, tmp_path, client, lambda _: cluster.failover()
        )
        assert _served_by(client.store.client) == cluster.master_port()
    finally:
        client.store.client.close()


class _CutShort(BaseException):
    """What Celery's soft time limit raises into a task: from a signal handler, mid-call."""


def _cut_short_then_echo(client: redis.Redis) -> list[Any]:
    """A BLPOP interrupted while blocked in its read (as a soft time limit interrupts a
    WAIT), then two ECHOs on the same client: what they answer."""

    def cut_short(_signum: int, _frame: object) -> None:
        raise _CutShort()

    previous = signal.signal(signal.SIGALRM, cut_short)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_CutShort):
            client.blpop(["saga:sentinel-test:nothing"], timeout=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return [client.echo("mine"), client.echo("again")]


def test_a_read_cut_short_drops_its_connection_so_the_next_command_reads_its_own_reply(
    cluster: SentinelCluster,
) -> None:
    client = redis_client(cluster.url(), decode_responses=True, socket_timeout=5)
    try:
        assert _cut_short_then_echo(client) == ["mine", "again"]  # not the BLPOP's late nil
    finally:
        client.close()


def test_the_brokers_sentinel_connections_drop_a_read_cut_short_too(
    cluster: SentinelCluster,
) -> None:
    app = _app(cluster)
    use_pooled_client_transport(app)
    assert app.conf.broker_transport == "saga-sentinel"
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert isinstance(channel, SentinelChannel)
        assert _cut_short_then_echo(channel.client) == [b"mine", b"again"]
