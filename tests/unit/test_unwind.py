"""The unwind as Celery sends it (``saga.unwind``): which undos its chain holds, in what order."""

from __future__ import annotations

from typing import Any

from celery import Celery

from saga import StepContext, ToolClass, ToolRegistry, Undo
from saga.constants import CONCLUDE_UNWIND_TASK
from saga.model import CompensationState, RunState
from saga.picture import CompensationRecord, RunPicture
from saga.unwind import unwind_chain

tools = ToolRegistry()


@tools.tool(
    ToolClass.REVERSIBLE_WRITE,
    compensation=lambda args, result: Undo("release", {"hold": result["hold"]}),
    reversal="ask",
)
def hold(ctx: StepContext, sku: str) -> dict[str, Any]:
    return {"hold": ctx.idempotency_key}


@tools.compensation()
def release(ctx: StepContext, hold: str) -> dict[str, Any]:
    return {"released": hold}


class Store:
    """The two things the chain needs of the store: its clock, and a failed undo recorded."""

    def now(self) -> float:
        return 100.0

    def record_compensation(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"no undo here is unrunnable: {args}")


def _entry(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "tool": "release",
        "args": {"hold": f"r:{step}"},
        "idempotency_key": f"r:{step}:undo",
        "description": f"release for step {step}",
        "ask": True,
    }


def test_an_undo_a_person_is_asked_about_keeps_its_place_at_the_head_of_the_chain() -> None:
    # Given: step 3 undone, step 2's undo waiting for a person's answer, step 1's still to run
    # (what a reaper pass that read the run just before step 2's undo asked takes over)
    compensations = [
        CompensationRecord(3, _entry(3), CompensationState.DONE, 1),
        CompensationRecord(2, _entry(2), CompensationState.ASKED, 0, ask_hash="ab" * 20),
        CompensationRecord(1, _entry(1), CompensationState.PENDING, 0),
    ]
    stack = [_entry(1), _entry(2)]
    picture = RunPicture(
        "r", RunState.UNWINDING, "aborted", None, [], stack, compensations, 1.0, None
    )
    # When: the unwind is sent again
    app = Celery("unwind-chain", set_as_current=False)
    store: Any = Store()
    chain = unwind_chain(app, tools, store, picture, "reaper:x", lambda task: {})
    # Then: it starts at the question (whose message stops the chain there), never below it
    assert [s.kwargs.get("compensates") for s in chain] == [2, 1, None]
    assert chain[-1].task == CONCLUDE_UNWIND_TASK
