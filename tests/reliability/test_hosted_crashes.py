"""Turn workers killed at the worst moments of a turn: the turn resumes on another worker with
no second model call, no call dispatched twice and none skipped; a lost turn is sent again by
the reaper.

Each test owns its Redis and workers (see conftest): a prefork worker for the tools and a
threads worker for the turns, running ``tests.integration.hosted_app``'s ``parallel`` agent:
turn 1 asks for get_order, issue_credit and set_ticket_status at once, turn 2 for send_reply,
turn 3 answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from saga import rules
from saga.agents import ScriptedPolicy, Transcript
from saga.agents.turn_state import TurnStore
from saga.client import Client, RunStatus
from saga.constants import TURN_QUEUE, agent_key, step_idempotency_key
from saga.model import ToolClass
from saga.testing import RedisServer, WorkerProcess
from tasks import systems
from tasks.agents import CREDIT, GET_ORDER, TICKET_STATUS
from tests.integration.helpers import wait_until
from tests.reliability.conftest import VISIBILITY_TIMEOUT, Private

pytestmark = pytest.mark.timeout(90)

APP = "tests.integration.hosted_app"
TOOLS = ["get_order", "issue_credit", "set_ticket_status", "send_reply"]


@pytest.fixture
def env(private: Callable[..., Private]) -> Iterator[Private]:
    """A private Redis with a tool worker; workers are SIGKILLed at teardown."""
    made = private()
    made.worker(APP, concurrency=2)
    yield made
    for worker in made.workers:
        worker.kill()


@pytest.fixture
def client(env: Private) -> Iterator[Client]:
    made = Client(broker_url=env.url + "/0", redis_url=env.url + "/0")
    yield made
    made.store.client.close()


def turn_worker(env: Private) -> WorkerProcess:
    return env.worker(APP, concurrency=4, pool="threads", extra_args=["-Q", TURN_QUEUE])


def died(worker: WorkerProcess, timeout: float = 20.0) -> None:
    assert worker.process is not None
    process = worker.process
    wait_until(lambda: process.poll() is not None, timeout, "the turn worker to die")
    worker.process = None


def completed(client: Client, run_id: str, timeout: float) -> RunStatus:
    def done() -> RunStatus | None:
        status = client.get_run(run_id)
        if status.state in ("compensated", "escalated", "failed_to_start"):  # fail now, and why
            raise AssertionError(f"run {run_id} ended {status.state}: {status.reason}")
        return status if status.state == "completed" else None

    found: RunStatus = wait_until(done, timeout, f"run {run_id} to complete")
    return found


def asked_per_turn(client: Client, run_id: str) -> dict[int, int]:
    """How often the policy was called for each turn, as the loop counted it in Redis."""
    fields = client.store.client.hgetall(agent_key(run_id))
    return {int(k.split(":")[0]): int(v) for k, v in fields.items() if k.endswith(":asked")}


def check_once_each(client: Client, run_id: str, turns: tuple[int, ...] = (1, 2, 3)) -> None:
    """The model was asked once per turn; every call got one step, and every effect exists
    once in the systems."""
    status = client.get_run(run_id)
    assert asked_per_turn(client, run_id) == dict.fromkeys(turns, 1)
    assert status.model_calls == len(turns)
    assert [s["tool"] for s in status.steps] == TOOLS
    assert [s["call"] for s in status.steps] == ["1:0", "1:1", "1:2", "2:0"]
    assert all(s["state"] == "succeeded" and s["attempts"] == 1 for s in status.steps)
    keys = [step_idempotency_key(run_id, n) for n in (2, 3, 4)]
    ledger = [e["idempotency_key"] for e in systems.ledger()]
    history = [h["idempotency_key"] for h in systems.ticket_history(9104)]
    outbox = [m["idempotency_key"] for m in systems.outbox()]
    assert (ledger, history, outbox) == ([keys[0]], [keys[1]], [keys[2]])


def test_kill_after_the_model_answered_resumes_without_asking_again(
    env: Private, client: Client
) -> None:
    # Given a turn worker that dies once turn 1's answer is recorded, before any dispatch
    env.faults.kill("after_model_answer", "parallel")
    first = turn_worker(env)
    run_id = client.enqueue_run("parallel", "Refund order 4921.")
    died(first)
    status = client.get_run(run_id)
    assert (status.model_calls, len(status.turns), status.steps) == (1, 1, [])

    # When another turn worker takes the unacknowledged turn over (after the visibility timeout)
    started = time.monotonic()
    turn_worker(env)
    completed(client, run_id, VISIBILITY_TIMEOUT * 4)

    # Then turn 1 was not asked again, and each call ran once
    assert time.monotonic() - started >= VISIBILITY_TIMEOUT / 2
    check_once_each(client, run_id)


def test_kill_between_the_second_and_third_dispatch_skips_none_and_repeats_none(
    env: Private, client: Client
) -> None:
    # Given a turn worker that dies right after dispatching call 2 of 3
    env.faults.kill("between_dispatches", nth=2)
    first = turn_worker(env)
    run_id = client.enqueue_run("parallel", "Refund order 4921.")
    died(first)
    calls = [s["call"] for s in client.get_run(run_id).steps]
    assert calls == ["1:0", "1:1"]

    # When another turn worker resumes the turn
    turn_worker(env)
    completed(client, run_id, VISIBILITY_TIMEOUT * 4)

    # Then call 3 was dispatched once, calls 1 and 2 not again, and the model asked once a turn
    check_once_each(client, run_id)


def test_a_call_settled_while_its_turn_still_dispatches_does_not_move_the_run_on(
    env: Private, client: Client
) -> None:
    # Given a turn that pauses after dispatching its first call, long enough for it to settle
    env.faults.delay("get_order", 3.0, point="between_dispatches")
    turn_worker(env)
    run_id = client.enqueue_run("parallel", "Refund order 4921.")

    def first_alone() -> bool:
        steps = client.get_run(run_id).steps
        return [(s["call"], s["state"]) for s in steps] == [("1:0", "succeeded")]

    wait_until(first_alone, 10, "call 1:0 to settle while 1:1 and 1:2 wait")
    # its settling did not end the turn
    assert client.store.client.hget(agent_key(run_id), "1:advanced") is None

    # When the turn goes on dispatching
    completed(client, run_id, 30)

    # Then the last call to settle moved the run on: every call once, the model once a turn
    check_once_each(client, run_id)


def test_a_call_reserved_but_never_sent_is_sent_once_on_resume(
    env: Private, client: Client
) -> None:
    # Given what a turn that died between the reserve script and the publish leaves behind:
    # turn 1's answer recorded, its first call reserved under its marker, no message sent
    run_id = client.enqueue_run("parallel", "Refund order 4921.")
    transcript = Transcript()
    transcript.add_user("Refund order 4921.")
    answer = ScriptedPolicy([[GET_ORDER, CREDIT, TICKET_STATUS]])(transcript, ())
    TurnStore(env.saga.store, 1 << 20).record_answer(run_id, 1, answer)
    gate = rules.gate_for(ToolClass.READ)
    reserved = env.saga.store.reserve(
        run_id, "get_order", ToolClass.READ, '{"order_id":4921}', gate, marker="1:0"
    )
    assert reserved.status == "ok"

    # When a turn worker takes turn 1's message
    turn_worker(env)
    completed(client, run_id, 30)

    # Then the reserved call ran once, the other two were dispatched once, turn 1 was not asked
    check_once_each(client, run_id, turns=(2, 3))


def test_a_lost_turn_is_sent_again_by_the_reaper(env: Private, client: Client) -> None:
    # Given a run whose first turn message is lost before any worker took it
    run_id = client.enqueue_run("parallel", "Refund order 4921.")
    assert env.saga.store.client.delete(TURN_QUEUE) == 1

    # When the reaper finds the run idle past its deadline, with a turn worker up
    turn_worker(env)
    later = env.saga.store.now() + 3600
    report = env.saga.reap(now=later)

    # Then it sends the turn again instead of abandoning the run, and the run completes
    assert report.resumed == [run_id] and report.abandoned == []
    completed(client, run_id, 30)
    check_once_each(client, run_id)


def test_a_run_that_stays_idle_is_abandoned_after_a_few_revivals(
    env: Private, client: Client
) -> None:
    # Given a run whose turns nobody takes (no turn worker at all)
    run_id = client.enqueue_run("parallel", "Refund order 4921.")
    later: Any = env.saga.store.now() + 3600

    # When the reaper looks again and again
    resumed = [bool(env.saga.reap(now=later + i * 3600).resumed) for i in range(4)]

    # Then it revives it three times, then aborts it as abandoned
    assert resumed == [True, True, True, False]
    wait_until(lambda: client.get_run(run_id).state == "compensated", 20, "the abort")


def test_a_turn_that_finds_the_stack_redis_away_plays_on_once_it_is_back(
    private: Callable[..., Private], tmp_path: Path
) -> None:
    # Given the stacks on a Redis of their own (the broker elsewhere), and a turn that pauses
    # after its first dispatch
    with RedisServer(directory=tmp_path / "broker") as broker:
        broker_url = broker.url + "/0"
        env = private(
            redis_args=("--appendonly", "yes", "--appendfsync", "always"),
            extra_env={"SAGA_BROKER_URL": broker_url, "SAGA_RESULT_BACKEND": broker_url},
        )
        env.worker(APP, concurrency=2)
        client = Client(broker_url=broker_url, redis_url=env.url + "/0")
        env.faults.delay("get_order", 3.0, point="between_dispatches")
        turn_worker(env)
        run_id = client.enqueue_run("parallel", "Refund order 4921.")

        def first_call_settled() -> bool:
            steps = client.get_run(run_id).steps
            return bool(steps) and steps[0]["state"] == "succeeded"

        # (settled, so the outage meets the turn, not that call's own delivery, which would
        # wait it out past its time limit and leave the step to the reaper)
        wait_until(first_call_settled, 10, "the first call")

        # When the stack's Redis is away as the turn goes on dispatching
        env.redis.kill()
        time.sleep(4.0)
        env.redis.start()

        # Then the turn plays again once it is back: every call once, the model once a turn
        try:
            completed(client, run_id, 40)
            check_once_each(client, run_id)
        finally:
            for worker in env.workers:
                worker.kill()
            client.store.client.close()
