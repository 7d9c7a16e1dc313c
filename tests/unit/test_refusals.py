"""Refusals that used to be a bare ``SagaError`` or said something untrue now have a class of
their own and a true message (no Redis: the store's answers are stubbed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from saga import Saga, Settings, ToolRegistry
from saga.errors import NothingToRequeueError, RunEndedError, SagaError
from saga.model import RunState
from saga.stack import Outcome, RunPicture


def test_a_run_still_unwinding_is_not_said_to_have_ended() -> None:
    """RunEndedError for an unwinding run says it is unwinding, not that it ended."""
    unwinding = RunEndedError("r1", RunState.UNWINDING.value)

    assert str(unwinding) == (
        "run r1 is unwinding (it ends once its undos have run): it takes no more calls"
    )
    assert "ended" not in str(unwinding)
    assert (unwinding.state, unwinding.ended) == ("unwinding", False)


@pytest.mark.parametrize("state", [RunState.COMPLETED, RunState.COMPENSATED, RunState.ESCALATED])
def test_a_run_that_ended_says_how(state: RunState) -> None:
    """For an ended run the message names the end state."""
    ended = RunEndedError("r1", state.value)

    assert str(ended) == f"run r1 has ended ({state.value}): it takes no more calls"
    assert ended.ended is True


@pytest.fixture
def saga() -> Iterator[Saga]:
    """A Saga whose Redis is never reached (its answers are stubbed per test)."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    made = Saga(Celery("refusals", set_as_current=False), ToolRegistry(), settings)
    yield made
    made.store.client.close()


def test_requeue_with_nothing_failed_raises_its_own_error(
    saga: Saga, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with no failed compensation gives NothingToRequeueError, not a bare SagaError."""
    monkeypatch.setattr(saga.store, "requeue", lambda run_id, *_: Outcome("ended", ("completed",)))
    picture = RunPicture("r1", RunState.COMPLETED, "", None, [], [], [], 0.0, 1.0, deadline=60.0)
    monkeypatch.setattr(saga.store, "picture", lambda run_id: picture)
    monkeypatch.setattr(saga.store, "now", lambda: 0.0)
    monkeypatch.setattr(saga.store, "schedule", lambda run_id, at: None)

    with pytest.raises(NothingToRequeueError) as refused:
        saga.requeue_failed_compensations("r1")

    assert type(refused.value) is not SagaError
    assert str(refused.value) == "run r1 is completed and has no failed compensation to requeue"
