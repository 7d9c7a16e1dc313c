"""The writes a failover must not lose count only once a replica holds them.

Replication is asynchronous: a master acknowledges a write before any replica has it, and a
failover then promotes a replica without it. With ``SAGA_REDIS_CONFIRM_REPLICAS=1`` each write
that counts (``saga.store_scripts.CONFIRMED_SCRIPTS``) is followed by ``WAIT``. Here a private
master has one replica, which the tests pause (``SIGSTOP``: a replica too slow, or cut off) and
resume: a real worker's step whose undo no replica confirmed is not reported settled (its
message not acked) until the replica has the undo, and its credit is applied once; a caller's
write no replica confirms is ``StoreUnavailableError`` (retryable), and the same call again
converges, for the sync store and the asyncio one alike.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from saga import RunState, Saga, Settings
from saga.aio_transport import AsyncRunStore
from saga.constants import run_keys
from saga.errors import ConfigurationError, StoreUnavailableError
from saga.model import StepState
from saga.stack import ReplicaConfirmation, RunStore
from saga.testing import RedisServer
from tests.integration.helpers import CREDIT, ORDER, wait_until
from tests.reliability.conftest import Private
from tests.reliability.test_crashes import credits_and_reversals, processed

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
CONFIRM = {"SAGA_REDIS_CONFIRM_REPLICAS": "1", "SAGA_REDIS_CONFIRM_TIMEOUT_MS": "200"}


class Replica:
    """A replica of a test's private Redis, which a test pauses and resumes."""

    def __init__(self, master: RedisServer, directory: Path) -> None:
        self.server = RedisServer(
            "--replicaof", "127.0.0.1", str(master.port), directory=directory
        ).start()
        self.client = redis.Redis(port=self.server.port, socket_timeout=5, decode_responses=True)
        self.paused = False
        wait_until(
            lambda: self.client.info("replication")["master_link_status"] == "up",
            what="the replica to sync",
        )

    def pause(self) -> None:
        assert self.server.process is not None
        os.kill(self.server.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.server.process is not None:
            os.kill(self.server.process.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()
        self.client.close()
        self.server.stop()


@pytest.fixture
def replicated(
    private: Callable[..., Private], tmp_path: Path
) -> Iterator[tuple[Private, Replica]]:
    """A private saga whose workers confirm their writes with one replica, and that replica.

    The workers' time limit is above their patience with an unreachable stack (30 s): the
    tests' usual 5 s would cut a step's wait for the replica short (the soft limit raises into
    it, the step is delivered again and finds its credit by its key), which on a busy machine
    came before the check that the wait holds the message unacked."""
    env = private(extra_env={**CONFIRM, "SAGA_TASK_TIME_LIMIT": "40"}, visibility_timeout=60)
    replica = Replica(env.redis, tmp_path / "replica")
    try:
        yield env, replica
    finally:
        for worker in env.workers:
            worker.kill()
        replica.stop()


@pytest.fixture
def confirming(replicated: tuple[Private, Replica]) -> Iterator[Saga]:
    """A caller (or a reaper) on the replicated saga's store that confirms its writes with the
    replica, as its workers do."""
    from tasks.tools import tools

    env, _ = replicated
    settings = replace(env.saga.settings, replicas_to_confirm=1, replica_confirm_timeout_ms=200)
    made = Saga(env.saga.app, tools, settings)
    yield made
    made.store.client.close()


def test_an_undo_no_replica_holds_yet_keeps_its_message_unacked_and_credits_once(
    replicated: tuple[Private, Replica],
) -> None:
    # Given a worker that confirms its writes, and a run with a read done
    env, replica = replicated
    worker = env.worker(concurrency=1)
    assert "fewer than the 1" not in worker.log()  # its start-up counted the replica
    assert "min-replicas-to-write 0: set it to 1" in worker.log()  # the master's guard is off
    run = env.saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=20)
    # (the caller reads the step's result once the master has it, before the worker's wait
    # for the replica ends: pausing the replica now would hold the read's task instead)
    wait_until(lambda: processed(worker, f"{run.run_id}:1"), what="the read's task to finish")

    # When the replica stops answering while the credit runs
    replica.pause()
    handle = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late")
    wait_until(lambda: credits_and_reversals(run.run_id) == (1, 0), what="the credit")
    time.sleep(1.5)

    # Then the credit happened and its outcome is written on the master, but the step's
    # message is not acked while no replica has its undo: the worker waits the missing
    # confirmation out as an outage (a failover now redelivers the step, whose lookup finds
    # the credit by its key: nothing is lost, nothing applied twice)
    task_id = f"{run.run_id}:{handle.step}"
    wait_until(lambda: "replica(s)" in worker.log(), what="the worker to say what it waits for")
    assert not processed(worker, task_id)

    # And once the replica is back, the message is acked, the undo on the replica, credited
    # once
    replica.resume()
    wait_until(lambda: processed(worker, task_id), what="the step's task to finish")
    assert handle.result(timeout=20)["amount_cents"] == CREDIT
    assert env.saga.picture(run.run_id).step(handle.step).state is StepState.SUCCEEDED
    stack_key = run_keys(run.run_id)[3]
    wait_until(lambda: replica.client.llen(stack_key) == 1, what="the undo on the replica")
    assert credits_and_reversals(run.run_id) == (1, 0)
    assert run.finish(timeout=20).state is RunState.COMPLETED


def until_confirmed(call: Callable[[], T], timeout: float = 20.0) -> T:
    """``call`` again while it is unavailable (the replica catching up): what a caller does
    with a retryable error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except StoreUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_callers_write_no_replica_confirms_is_unavailable_and_converges_when_repeated(
    replicated: tuple[Private, Replica],
) -> None:
    env, replica = replicated
    settings = replace(Settings(), replicas_to_confirm=1, replica_confirm_timeout_ms=100)
    url = env.url + "/0"
    store = RunStore.for_settings(settings, url)

    def create_async(run_id: str) -> bool:
        async def create() -> bool:
            aio = AsyncRunStore(url, settings)
            try:
                return await aio.create(run_id, 60.0, "", "", False)
            finally:
                await aio.redis.aclose()

        return asyncio.run(create())

    try:
        # Given a replica that does not answer
        replica.pause()

        # When a run is created, by the sync store and by the asyncio one
        with pytest.raises(StoreUnavailableError, match="confirmed by 0 of 1 replica"):
            store.create("sync-run", 60.0)
        with pytest.raises(StoreUnavailableError, match="confirmed by 0 of 1 replica"):
            create_async("async-run")

        # Then each stands on the master only; once the replica is back the same call again
        # is confirmed and says the run exists (it is not made twice)
        assert store.head("sync-run") is not None and store.head("async-run") is not None
        replica.resume()
        assert until_confirmed(lambda: store.create("sync-run", 60.0)) is False
        assert until_confirmed(lambda: create_async("async-run")) is False
        for run_id in ("sync-run", "async-run"):
            assert replica.client.hget(run_keys(run_id)[0], "state") == "running"
    finally:
        store.client.close()


def test_a_turn_asks_its_model_only_once_the_ask_is_on_a_replica_and_once_only(
    replicated: tuple[Private, Replica],
) -> None:
    """A failover that lost a turn's ask would have the model asked again: the ask (and the
    answer) count only once a replica holds them, and the same delivery's repeat counts once."""
    from saga.client import Client
    from saga.constants import TURN_QUEUE
    from tests.reliability.test_hosted_crashes import APP, asked_per_turn, completed

    # Given a hosted run enqueued while the replica answers, and no turn worker yet
    env, replica = replicated
    env.worker(APP, concurrency=2)
    client = Client(broker_url=env.url + "/0", redis_url=env.url + "/0")
    try:
        run_id = client.enqueue_run("parallel", "Refund order 4921.")

        # When the replica stops answering as a turn worker takes the first turn
        replica.pause()
        turns = env.worker(APP, concurrency=4, pool="threads", extra_args=["-Q", TURN_QUEUE])
        wait_until(
            lambda: "ask_model was confirmed by 0 of 1 replica(s)" in turns.log(),
            what="the turn to wait for its ask's confirmation",
        )
        time.sleep(1.0)

        # Then the model is not asked while no replica holds the ask (no answer waits to be
        # recorded), and once the replica is back each turn's model is asked once
        assert "record_answer was confirmed" not in turns.log()
        assert client.get_run(run_id).turns == []
        replica.resume()
        completed(client, run_id, 60)
        assert asked_per_turn(client, run_id) == {1: 1, 2: 1, 3: 1}
        assert client.get_run(run_id).model_calls == 3
    finally:
        client.store.client.close()


def test_a_call_whose_reservation_no_replica_holds_is_released_and_never_sent(
    replicated: tuple[Private, Replica], confirming: Saga
) -> None:
    """A failover would lose a reservation the master alone holds, and the caller's handle
    would name a step that no longer exists: the step is confirmed before its message is sent;
    unconfirmed, it is released, nothing sent, and the call is retryable."""
    # Given a caller that confirms its writes, and a run
    env, replica = replicated
    env.worker(concurrency=1)
    run = confirming.start_run()

    # When it calls the credit while no replica answers
    replica.pause()
    with pytest.raises(StoreUnavailableError, match="reserve was confirmed by 0 of 1"):
        run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="x")

    # Then the step is released with nothing sent: no credit, however long one waits
    assert run.picture().step(1).state is StepState.NOT_DISPATCHED
    time.sleep(1.5)
    assert credits_and_reversals(run.run_id) == (0, 0)

    # And once the replica is back, calling again credits once
    replica.resume()
    handle = until_confirmed(
        lambda: run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="x")
    )
    assert handle.result(timeout=20)["amount_cents"] == CREDIT
    assert credits_and_reversals(run.run_id) == (1, 0)


def test_a_reaped_abort_no_replica_confirms_is_looked_at_again_at_the_next_pass(
    replicated: tuple[Private, Replica], confirming: Saga
) -> None:
    """The reaper's abort of an abandoned run stands on the master unconfirmed (the run is
    ``unwinding``, no chain sent): it must be looked at again soon, not in five minutes."""
    # Given a run with a credit, abandoned by its agent, and a reaper that confirms its writes
    env, replica = replicated
    env.worker(concurrency=1)
    reaper = confirming
    run = env.saga.start_run(deadline=1.0)
    run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="x").result(timeout=20)
    time.sleep(1.5)

    # When the reaper aborts it while no replica answers
    replica.pause()
    report = reaper.reap()

    # Then the abort stands on the master, unconfirmed, and the run is due again at once
    assert [r for r, _ in report.broken] == [run.run_id]
    assert "confirmed by 0 of 1" in report.broken[0][1]
    assert run.state() is RunState.UNWINDING
    due = reaper.store.due_at(run.run_id)
    assert due is not None and due - reaper.store.now(exact=True) < 5

    # And once the replica is back, the next passes send the unwind: the credit reversed
    replica.resume()

    def compensated() -> bool:
        reaper.reap()
        return run.state() is RunState.COMPENSATED

    wait_until(compensated, timeout=30, what="the reaper to unwind the run")
    assert credits_and_reversals(run.run_id) == (1, 1)


def test_a_confirmation_covers_the_writes_of_other_connections_too(
    replicated: tuple[Private, Replica],
) -> None:
    """``WAIT`` counts the writes of its own connection only: a pool that lends the ``WAIT``
    another connection than the write's (another thread took that one back meanwhile) would
    call a write no replica holds confirmed. The confirmation writes first on its own."""
    env, replica = replicated
    settings = replace(Settings(), replicas_to_confirm=1, replica_confirm_timeout_ms=100)
    store = RunStore.for_settings(settings, env.url + "/0")
    other = redis.Redis.from_url(env.url + "/0")
    try:
        # Given the store's connection open, having written nothing, and a paused replica
        store.client.ping()
        replica.pause()

        # When a write is made on another connection (as another thread's would be)
        other.set("saga:test:written-elsewhere", "1")

        # Then the store's confirmation does not call it held
        with pytest.raises(StoreUnavailableError, match="confirmed by 0 of 1"):
            store.confirm("a write made on another connection", "some-run")
        replica.resume()
        until_confirmed(lambda: store.confirm("the same, the replica back", "some-run"))
        assert replica.client.get("saga:test:written-elsewhere") == "1"
    finally:
        store.client.close()
        other.close()


def test_a_worker_that_would_wait_for_missing_replicas_says_so_at_start_up(
    private: Callable[..., Private],
) -> None:
    env = private(extra_env=CONFIRM)
    worker = env.worker(concurrency=1)
    try:
        log = worker.log()
        assert "has 0 replica(s), fewer than the 1 each write that counts waits for" in log
        assert "ready" in log  # warned, not refused: a replica may be restarting
    finally:
        worker.kill()


def test_a_confirmation_that_could_block_for_good_is_refused() -> None:
    assert not ReplicaConfirmation().wanted("record_success")
    assert ReplicaConfirmation(1).wanted("record_success")
    assert not ReplicaConfirmation(1).wanted("reserve")  # repeated or reconciled when lost
    with pytest.raises(ConfigurationError, match="timeout above 0 ms"):
        ReplicaConfirmation(1, 0)  # WAIT 1 0 waits forever
    with pytest.raises(ConfigurationError, match="0 or more"):
        ReplicaConfirmation(-1)
