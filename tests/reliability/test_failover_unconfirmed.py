"""With replica confirmation off, a Sentinel failover loses what the replica had not received,
and what that leaves behind is reported, never reversed.

A master, a replica and three sentinels of the test's own. Once the replica holds a run's
read, it is stopped (``SIGSTOP``) and its link to the master cut; the run then credits $2,500
and completes, recorded in SQL, and a second run credits too, all on the master alone (nothing
waits for a replica). Then the master stops answering and the replica, which never received
any of it, is promoted; the old master comes back as a replica of the new one and drops what
it held.

What is lost: the first run's credit and completion (its keys are back at ``running`` after
the read), and the whole second run (its credit is real, and nothing in Redis or SQL says to
undo it: the cost replica confirmation, ``SAGA_REDIS_CONFIRM_REPLICAS``, exists to avoid).
What is reported: the reaper finds the first run's keys older than its SQL record and
escalates it, reversing nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from saga import RunState, UnknownRunError
from saga.rules import REASON_STORE_BEHIND
from saga.testing import RedisServer, WorkerProcess
from tasks import systems
from tests.conftest import ROOT, service_missing
from tests.integration.helpers import CREDIT, ORDER, wait_until
from tests.reliability.sentinel_cluster import SentinelCluster, role
from tests.reliability.test_crashes import credits_and_reversals
from tests.reliability.test_sentinel import demo_env, demo_saga

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    with SentinelCluster(tmp_path / "sentinel") as running:
        yield running


def _pid(server: RedisServer) -> int:
    assert server.process is not None
    return server.process.pid


def test_without_replica_confirmation_a_failover_loses_writes_and_the_reaper_reverses_nothing(
    cluster: SentinelCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker that does not confirm its writes with the replica
    env = demo_env(cluster, tmp_path, SAGA_RUN_DEADLINE="1")
    saga = demo_saga(cluster, env, monkeypatch, run_deadline_seconds=1)
    assert saga.settings.replicas_to_confirm == 0
    master, replica = cluster.master, cluster.replica
    assert cluster.master_port() == master.port
    worker = WorkerProcess(
        "tasks.app", env=env, concurrency=1, cwd=ROOT, logfile=tmp_path / "worker.log"
    )
    try:
        with worker:
            # A run whose read the replica holds; then the replica stops receiving anything
            run = saga.start_run()
            run.call("get_order", order_id=ORDER).result(timeout=30)
            wait_until(lambda: cluster._in_sync(replica.port), 30, "the replica to hold the read")
            # (stopped, and cut off: what the master sends a stopped process still lands in its
            # socket's buffer, and would be read on waking)
            os.kill(_pid(replica), signal.SIGSTOP)
            on_master = redis.Redis(port=master.port, socket_timeout=5)
            try:
                on_master.client_kill_filter(_type="replica")
                on_master.close()
                # The run credits and completes, recorded in SQL; a second run credits too
                run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late").result(
                    timeout=30
                )
                done = run.finish(timeout=30)
                second = saga.start_run()
                second.call(
                    "issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="second"
                ).result(timeout=30)
            finally:
                # When the master stops answering and the replica is promoted without them
                os.kill(_pid(master), signal.SIGSTOP)
                os.kill(_pid(replica), signal.SIGCONT)
            try:
                wait_until(
                    lambda: cluster.master_port() == replica.port,
                    60,
                    "the sentinels to promote the replica",
                )
            finally:
                os.kill(_pid(master), signal.SIGCONT)
            wait_until(
                lambda: role(master.port) == "slave" and cluster._in_sync(master.port),
                60,
                "the old master to rejoin as a replica and drop what it held",
            )
    finally:
        os.kill(_pid(replica), signal.SIGCONT)  # (a no-op when it runs)
        os.kill(_pid(master), signal.SIGCONT)
    assert done.state is RunState.COMPLETED
    recorded = saga.records.run(run.run_id)
    assert recorded is not None and recorded.state == "completed"

    # Then what the replica never received is gone: the first run is running again after its
    # read, and the second run is gone altogether, its credit real and undone by nothing
    behind = saga.picture(run.run_id)
    assert behind.state is RunState.RUNNING and len(behind.steps) == 1
    with pytest.raises(UnknownRunError):
        saga.picture(second.run_id)
    assert credits_and_reversals(second.run_id) == (1, 0)
    assert saga.records.run(second.run_id) is None

    # And the reaper, finding the first run past its deadline, reports its keys behind its
    # record (an escalation naming both versions) and reverses nothing
    wait_until(
        lambda: [r for r, _ in saga.reap().behind] == [run.run_id],
        30,
        "the reaper to find the run behind its record",
    )
    escalation = saga.records.escalation(f"{run.run_id}:reaper")
    assert escalation is not None and escalation.reason == REASON_STORE_BEHIND
    assert f"completed at version {recorded.version}" in (escalation.cause or "")
    assert credits_and_reversals(run.run_id) == (1, 0)
    after = saga.records.run(run.run_id)
    assert after is not None and (after.state, after.version) == ("completed", recorded.version)
    saga.store.client.close()
    saga.records.dispose()
    systems.dispose_engines()
