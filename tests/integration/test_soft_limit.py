"""Celery's soft time limit arriving while saga records an undo's failure, not while the undo
runs: saga finishes recording and the unwind goes on, on a real prefork worker. And in a
hosted turn played in a prefork pool: a model call it cuts short is asked again, and one that
arrives while the answer is recorded leaves the answer recorded and the run going on.

The soft limit is a ``SIGUSR1`` billiard's timer sends the pool process. Its timer ticks once
a second, so where it lands is left to chance; this test sends the signal itself, at the
moment it means: the pool process held at ``after_compensation_failed`` (the reversal raised,
its retry not yet recorded). Before ``saga.soft_limit``, billiard's handler raised there, the
message was acknowledged as failed with no retry recorded or sent, and the run stayed
unwinding until the reaper's deadline (this deployment has no reaper).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga import RunState
from saga.testing import Faults
from tasks import systems
from tasks.agents import declare
from tests.integration.deployment import Deployment, deployment
from tests.integration.helpers import compensated_steps, demo_steps, wait_until


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """A private deployment whose worker has one pool process, the one the signal goes to; it
    plays the hosted turns too (the demo app's ``refund`` agent)."""
    worker_args = ["-c", "1", "-Q", "celery,saga.turns"]
    with deployment(tmp_path_factory.mktemp("soft-limit"), {}, worker_args) as made:
        declare(made.saga)  # the demo app's agents, as its worker hosts them
        yield made


def pool_process(worker_pid: int) -> int:
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    assert len(children) == 1, f"expected one pool process, found {children}"
    return int(children[0])


def test_a_soft_limit_while_an_undos_failure_is_recorded_loses_nothing(
    single: Deployment,
) -> None:
    # Given a run whose credit's first reversal fails (the second succeeds)
    systems.clear_switches()
    systems.reset()
    faults = Faults(single.saga.store.client)
    faults.clear()
    run = single.saga.start_run()
    assert len(demo_steps(run, upto=3)) == 3
    systems.fail_next("reversal", 1)
    held = faults.delay("reverse_credit", 3.0, point="after_compensation_failed")

    # When the soft limit arrives while saga records that failure
    run.abort("the customer cancelled")
    wait_until(lambda: faults.hits(held) == 1, 30, "the failed reversal held before its record")
    os.kill(pool_process(single.worker.pid), signal.SIGUSR1)

    # Then the retry is recorded and sent: the unwind ends compensated, each undo done once
    wait_until(
        lambda: single.saga.picture(run.run_id).state is RunState.COMPENSATED,
        30,
        f"run {run.run_id} compensated",
    )
    picture = single.saga.picture(run.run_id)
    assert compensated_steps(picture) == [3, 2]
    assert [c.attempts for c in picture.compensations if c.step == 2] == [2]
    log = single.worker_log()
    assert "the soft time limit came while saga recorded the delivery" in log
    assert "SoftTimeLimitExceeded" not in log
    faults.clear()


def hosted_run_held_at(single: Deployment, point: str) -> tuple[str, int]:
    """A hosted ``refund`` run whose first model call is held at ``point``, the soft limit
    sent to the pool process there; its id and where the worker's log stood before it."""
    systems.clear_switches()
    systems.reset()
    faults = Faults(single.saga.store.client)
    faults.clear()
    before = len(single.worker_log())
    held = faults.delay("refund", 3.0, point=point)
    run_id = single.saga.enqueue_run("refund", "Order 4921 arrived late: refund it.")
    wait_until(lambda: faults.hits(held) == 1, 30, f"the first model call held at {point}")
    os.kill(pool_process(single.worker.pid), signal.SIGUSR1)
    wait_until(lambda: single.saga.picture(run_id).state.ended, 60, f"hosted run {run_id} to end")
    faults.clear()
    return run_id, before


@pytest.mark.parametrize(
    ("point", "told"),
    [
        # the model call overran: asked again, not taken for a broken policy
        ("during_model_call", "the model did not answer within the task's soft time limit; asking"),
        # the answer came back, the soft limit before its record: recorded, the turn finished
        ("after_model_call", "the soft time limit came while saga recorded the delivery"),
    ],
    ids=["in-the-model-call", "while-the-answer-is-recorded"],
)
def test_a_soft_limit_in_a_hosted_turn_loses_nothing(
    single: Deployment, point: str, told: str
) -> None:
    # Given a hosted run whose first model call is held at the point, the soft limit sent there
    run_id, before = hosted_run_held_at(single, point)

    # Then the run goes on to complete: one credit, one reply
    picture = single.saga.picture(run_id)
    log = single.worker_log()[before:]
    assert picture.state is RunState.COMPLETED, log
    assert told in log
    assert "the policy failed" not in log and "SoftTimeLimitExceeded" not in log
    assert len(systems.ledger()) == 1 and len(systems.outbox()) == 1
