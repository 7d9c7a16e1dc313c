"""A demo run driven through a store failover at one point of it, and what must hold after:
shared by the Sentinel and the Redis Cluster tests, which differ only in how they fail over."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from saga import Saga
from saga.client import Client
from saga.constants import TURN_QUEUE
from saga.errors import StoreUnavailableError
from saga.model import RunState
from saga.testing import Faults, WorkerProcess
from tasks import systems
from tests.conftest import ROOT
from tests.integration.helpers import CREDIT, ORDER, wait_until
from tests.reliability.test_hosted_crashes import check_once_each, completed

HOSTED_APP = "tests.integration.hosted_app"

#: Where the failover strikes: while the credit runs; once its success and undo are recorded,
#: before its message is acknowledged; while its reversal runs; once the unwind's conclusion
#: is written in Redis, before its SQL record is. (tool, fault point)
FAILOVER_POINTS = {
    "mid-step": ("issue_credit", "before_effect"),
    "between-the-push-and-the-ack": ("issue_credit", "after_push"),
    "during-the-unwind": ("reverse_credit", "before_compensation"),
    "during-the-conclusion": ("", "after_conclusion"),
}


def faults_on(saga: Saga, monkeypatch: pytest.MonkeyPatch) -> Faults:
    monkeypatch.setenv("SAGA_TESTING_FAULTS", "1")
    return Faults(saga.store.client)


def confirming(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment that confirms its writes with a replica (on a cluster, of the
    master of the run's slot), with faults on. A time limit the wait for a replica after the
    failover fits in (the new master has none until the old one rejoins it): the tests' 5 s
    would cut the step short. The visibility timeout just above it: a delivery whose ack the
    failover lost comes back then."""
    return {
        **env,
        "SAGA_TESTING_FAULTS": "1",
        "SAGA_REDIS_CONFIRM_REPLICAS": "1",
        "SAGA_TASK_TIME_LIMIT": "15",
        "SAGA_VISIBILITY_TIMEOUT": "20",
    }


def run_through_failover(
    saga: Saga, faults: Faults, tool: str, at: str, fail_over: Callable[[str], None]
) -> None:
    """A run that credits (and, for a failover in the unwind, is aborted), held at ``at`` of
    ``tool`` while ``fail_over(run_id)`` fails the store over: it ends as it would have
    without the failover, the credit and its reversal each applied once, Redis (the new
    master's keys) and SQL agreeing."""
    forward = at in ("before_effect", "after_push")
    run = saga.start_run()
    run.call("get_order", order_id=ORDER).result(timeout=30)
    delayed = faults.delay(tool, 3.0, point=at)
    credit = run.call("issue_credit", order_id=ORDER, amount_cents=CREDIT, memo="late")
    if forward:
        wait_until(lambda: faults.hits(delayed) > 0, 30, f"the credit to reach {at}")
        fail_over(run.run_id)
        assert credit.result(timeout=90)["amount_cents"] == CREDIT
        ended = _finish(run, 90)
        expected, reversals = RunState.COMPLETED, 0
    else:
        credit.result(timeout=30)
        run.abort("the customer cancelled")
        wait_until(lambda: faults.hits(delayed) > 0, 30, f"the unwind to reach {at}")
        fail_over(run.run_id)
        ended = run.wait(timeout=90)
        expected, reversals = RunState.COMPENSATED, 1
    assert faults.hits(delayed) >= 1
    assert ended.state is expected, (ended.state, ended.reason)
    ledger = [r for r in systems.ledger() if r["idempotency_key"].startswith(f"{run.run_id}:")]
    assert sum(r["kind"] == "credit" for r in ledger) == 1
    assert sum(r["kind"] == "reversal" for r in ledger) == reversals
    record = saga.records.run(run.run_id)
    assert record is not None and record.state == expected.value
    assert saga.picture(run.run_id).state is expected  # the new master's keys


def hosted_turn_through_failover(
    saga: Saga,
    env: dict[str, str],
    faults: Faults,
    logs: Path,
    client: Client,
    fail_over: Callable[[str], None],
) -> None:
    """A hosted turn dispatching its three calls, paused after the first while
    ``fail_over(run_id)`` fails the store over: each call dispatched and applied once, the
    model asked once a turn, the run completed in Redis and in SQL."""
    confirming_env = confirming(env)
    tools_worker = WorkerProcess(
        HOSTED_APP, env=confirming_env, concurrency=2, cwd=ROOT, logfile=logs / "tools.log"
    )
    turns_worker = WorkerProcess(
        HOSTED_APP,
        env=confirming_env,
        concurrency=4,
        pool="threads",
        extra_args=["-Q", TURN_QUEUE],
        cwd=ROOT,
        logfile=logs / "turns.log",
    )
    paused = faults.delay("get_order", 3.0, point="between_dispatches")
    with tools_worker, turns_worker:
        run_id = client.enqueue_run("parallel", "Refund order 4921.")
        wait_until(lambda: faults.hits(paused) > 0, 30, "the turn's first dispatch")
        fail_over(run_id)
        completed(client, run_id, 120)
    check_once_each(client, run_id)
    record = saga.records.run(run_id)
    assert record is not None and record.state == "completed"


def _finish(run: Any, timeout: float) -> Any:
    """``Run.finish``, retried while the store is still away (a killed master's slots have no
    master until its replica is promoted): the caller's retry, as an agent's."""

    def attempt() -> Any:
        try:
            return run.finish(timeout=timeout)
        except StoreUnavailableError:
            return None

    return wait_until(attempt, timeout, "the run to finish")
