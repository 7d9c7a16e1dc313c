"""A run from the records as a drill's scenario (``saga drill --from-run RUN``): the calls it
made, each tool with the arguments recorded for its step, made again in their order on the
drill's run.

The calls are read from the stack's Redis while the run's keys live, else from its SQL record
(``saga_steps``); neither is touched. A step that was refused before it was dispatched
(``not_dispatched``) is left out: the agent's call never became a step. A replayed call that
the tool refuses (``StepRejectedError``: fed back) lets the run go on, as it did for the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from saga.errors import SagaError, StepRejectedError
from saga.model import StepState

if TYPE_CHECKING:
    from saga.records import RecordStore
    from saga.runs import Run
    from saga.stack import RunStore


class RecordedRunError(SagaError):
    """The run to replay is in neither the stack's Redis nor the records, or made no call."""


@dataclass(frozen=True)
class RecordedCall:
    """One call of a recorded run: its step, its tool and the arguments as recorded."""

    step: int
    tool: str
    args: dict[str, Any]


def calls_of(steps: Sequence[tuple[int, str, dict[str, Any], str]]) -> list[RecordedCall]:
    """The calls to make again, in step order, from ``(step, tool, args, state)`` rows."""
    return [
        RecordedCall(step, tool, dict(args or {}))
        for step, tool, args, state in sorted(steps, key=lambda row: row[0])
        if state != StepState.NOT_DISPATCHED.value
    ]


def recorded_calls(store: RunStore | None, records: RecordStore, run_id: str) -> list[RecordedCall]:
    """The calls run ``run_id`` made, from Redis (``store``; None: not reachable) or SQL."""
    picture = store.picture(run_id) if store is not None else None
    if picture is not None:
        rows = [(s.step, s.tool, s.args, s.state.value) for s in picture.steps]
    else:
        if records.run(run_id) is None:
            raise RecordedRunError(f"no run {run_id} in the stack's Redis or in the records")
        rows = [(r.step, r.tool, r.args, r.state) for r in records.steps(run_id)]
    calls = calls_of(rows)
    if not calls:
        raise RecordedRunError(f"run {run_id} made no call to replay")
    return calls


class Replay:
    """A scenario that makes ``calls`` again (``setup`` first: a known world for each case),
    waiting for each result, then finishes the run."""

    def __init__(
        self,
        run_id: str,
        calls: Sequence[RecordedCall],
        *,
        setup: Callable[[], Any] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.run_id = run_id
        self.calls = list(calls)
        self.setup = setup
        self.timeout = timeout
        #: What the drill's reports call it.
        self.__qualname__ = f"run {run_id}"

    def __call__(self, run: Run) -> None:
        if self.setup is not None:
            self.setup()
        for call in self.calls:
            try:
                run.call(call.tool, **call.args).result(timeout=self.timeout)
            except StepRejectedError:
                continue  # fed back: the agent was told, and the run went on
        run.finish(timeout=self.timeout)


def with_setup(setup: Callable[[], Any], scenario: Callable[[Run], Any]) -> Callable[[Run], Any]:
    """``scenario``, with ``setup`` called before each play of it."""

    def play(run: Run) -> Any:
        setup()
        return scenario(run)

    play.__qualname__ = getattr(scenario, "__qualname__", repr(scenario))
    return play
