"""The dispatcher: one agent-chosen call becomes a Celery task, under the pivot rules, or is
refused having changed nothing.

The step is reserved in Redis first (one script judges the call against the run's rules and
records it), then its message is published. A publish that raises releases the step again,
unless a worker began it meanwhile (the message did get through): calling again would then make
a second step, so the caller gets the step as it is.

Where the step's message is prepared (``saga.prepared_publish``: Celery's own bytes, pushed on
the store's connection), the reservation's script pushes it itself when it reserves the step
the message was made for, the run's next as this process last saw it: one round trip, and a
message that exists exactly when its step does. Otherwise it is published as above.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery

from saga import payload, rules
from saga.constants import tool_task_name
from saga.errors import (
    DispatchError,
    RunContendedError,
    RunEndedError,
    StoreUnavailableError,
    UnknownRunError,
)
from saga.model import StepState, ToolClass
from saga.picture import StepRecord
from saga.prepared_publish import PreparedPublisher
from saga.settings import Settings
from saga.stack import RunStore, StepPush
from saga.tool_hosts import CallerTools
from saga.tools import ToolRegistry
from saga.transport import declares_nothing

logger = logging.getLogger("saga")

#: How often the dispatcher re-reads a run that changed under it before giving up.
_RESERVE_ATTEMPTS = 100
#: Characters of a step's arguments shown in Flower (Celery's own repr limit).
_REPR = 1024
#: Runs whose next step this process remembers (``Dispatcher._guess_next_step``).
_GUESSED_RUNS = 4096


def _step_message(
    run_id: str, step: int, tool_name: str, wire_args: Any, args_json: str
) -> tuple[str, str, dict[str, Any], str]:
    """A step's task, task id, keyword arguments and what Flower shows of them: the JSON
    already encoded, not a second, recursive repr."""
    kwargs = {"run_id": run_id, "step": step, "args": wire_args}
    kwargsrepr = f"{{'run_id': {run_id!r}, 'step': {step}, 'args': {args_json[:_REPR]}}}"
    return tool_task_name(tool_name), f"{run_id}:{step}", kwargs, kwargsrepr


class Dispatcher:
    """The dispatch half of ``saga.core.Core`` (a mixin over its app, registry and store)."""

    app: Celery
    registry: ToolRegistry
    settings: Settings
    store: RunStore
    caller_tools: CallerTools
    #: Publish options by task name (``_publish_options``), worked out on first use.
    _publish_extra: dict[str, dict[str, Any]]
    #: A step's message prepared once per task and pushed directly, where nothing can tell.
    prepared: PreparedPublisher
    #: Per run, the step its next call will most likely be given (``_guess_next_step``).
    _next_steps: dict[str, int]
    _next_steps_lock: threading.Lock

    def start_unwind(self, run_id: str, owner: str) -> bool:
        raise NotImplementedError  # the core's: a released step may own the run's unwind

    def dispatch(
        self,
        run_id: str,
        tool_name: str,
        args: dict[str, Any],
        *,
        marker: str = "",
        feed_back_failure: bool = False,
    ) -> int:
        """Turn one agent-chosen call into a Celery task, or refuse it having changed nothing;
        returns its step (``Run.call`` hands out its ``StepHandle``).

        ``marker`` (the hosted loop's ``<turn>:<call>``) is recorded with the step when it is
        reserved: dispatching the same marker again returns that step, sending its message
        again only if no delivery has begun it (the task's check-before-run makes a second
        message a replay). ``feed_back_failure``: a final failure is ``rejected``, not an
        unwind (the agent tells the model)."""
        tool = self.registry.offered(tool_name)
        assert tool.tool_class is not None
        self.caller_tools.check(tool_name)
        wire_args = tool.validate(args)
        args_json = payload.dumps(
            wire_args, what=f"arguments of {tool_name}", limit=self.settings.max_payload_bytes
        )
        on_failure = "feed_back" if feed_back_failure else ""
        push = self._push_with_reservation(run_id, tool_name, wire_args, args_json, marker)
        step, fresh, sent = self._reserve(
            run_id, tool_name, tool.tool_class, args_json, marker, on_failure, push
        )
        if fresh:
            self._guess_next_step(run_id, step + 1)
        if sent:
            return step  # the reservation pushed its message too
        if not fresh and self.store.step_outcome(run_id, step)[0] != StepState.DISPATCHED:
            return step  # begun or settled already
        try:
            # With replica confirmation on, the step's reservation is on a replica before its
            # message exists: a failover never loses a step whose handle the caller holds.
            self.store.confirm("reserve", run_id)
        except StoreUnavailableError as exc:
            self._unsend(run_id, step, tool_name, exc)
            raise
        try:
            self._send_step(run_id, step, tool_name, wire_args, args_json)
        except Exception as exc:
            if self._unsend(run_id, step, tool_name, exc):
                return step
            raise DispatchError(f"the broker did not take {tool_name}: {exc}") from exc
        return step

    def resend(self, run_id: str, record: StepRecord) -> None:
        """Send the message of a step no delivery began once more, as it was first sent (same
        task id, same arguments): the reaper's, when the broker lost it (one without
        persistence, restarted). A second copy that does arrive is a replay: the task's
        check-before-run runs the step once."""
        args_json = payload.dumps(record.args, what=f"arguments of {record.tool}", limit=1 << 62)
        self._send_step(run_id, record.step, record.tool, record.args, args_json)

    def _push_with_reservation(
        self, run_id: str, tool_name: str, wire_args: Any, args_json: str, marker: str
    ) -> StepPush | None:
        """The message of the step this call will most likely be given (the run's next, as
        this process last reserved one), prepared for the reservation to push in the same
        script: one round trip instead of two. None where the message must wait for the
        reservation: Celery's publish sends it (``saga.prepared_publish``), a marker's call
        may be given its earlier step, and with replica confirmation on, the reservation is
        on a replica before the message exists."""
        if marker or self.store.confirmation.replicas:
            return None
        step = self._next_steps.get(run_id, 1)
        message = self.prepared.message(
            *_step_message(run_id, step, tool_name, wire_args, args_json)
        )
        if message is None:
            return None
        return StepPush(message[0], step, message[1])

    def _guess_next_step(self, run_id: str, step: int) -> None:
        """Remember the step this run's next call will most likely be given (a few thousand
        runs at most: a guess is only a guess, and a wrong one costs a second round trip)."""
        steps = self._next_steps
        with self._next_steps_lock:
            steps.pop(run_id, None)
            steps[run_id] = step
            while len(steps) > _GUESSED_RUNS:
                del steps[next(iter(steps))]

    def _send_step(
        self, run_id: str, step: int, tool_name: str, wire_args: Any, args_json: str
    ) -> None:
        task, task_id, kwargs, kwargsrepr = _step_message(
            run_id, step, tool_name, wire_args, args_json
        )
        if self.prepared.publish(task, task_id, kwargs, kwargsrepr):
            return
        self.app.send_task(
            task,
            kwargs=kwargs,
            task_id=task_id,
            # The outcome lives in the saga store: no result backend subscription (a
            # SUBSCRIBE and an UNSUBSCRIBE per step).
            ignore_result=True,
            argsrepr="()",
            kwargsrepr=kwargsrepr,
            **self._publish_options(task),
        )

    def _unsend(self, run_id: str, step: int, tool_name: str, exc: Exception) -> bool:
        """Release a step whose message was not sent (the broker refused it, or its
        reservation is on no replica yet); True when a delivery began it meanwhile (the
        message got through after all: the caller gets the step as it is). A release the
        store does not take leaves the step ``dispatched`` with no message: the reaper finds
        it never started."""
        error = {"type": type(exc).__name__, "message": str(exc)}
        try:
            released = self.store.release(run_id, step, error)
        except StoreUnavailableError:
            if isinstance(exc, StoreUnavailableError):
                return False  # the store is away: the caller is told so
            raise
        if released.status == "started":
            # The publish raised, yet the message got through and a worker began the step:
            # the truth is "it is running", and calling again would make a second step.
            logger.warning(
                "run %s step %d (%s): the broker raised %r but the step is %s; "
                "returning its handle",
                run_id,
                step,
                tool_name,
                exc,
                released.values[0],
            )
            return True
        if released.owns_unwind:
            self.start_unwind(run_id, f"step:{step}")
        return False

    def _publish_options(self, task: str) -> dict[str, Any]:
        """What a message of ``task`` is published with besides its own: no declaration of a
        queue the publish does not need declared (``saga.transport.declares_nothing``)."""
        options = self._publish_extra.get(task)
        if options is None:
            skip = declares_nothing(self.app, task)
            options = self._publish_extra[task] = {"declare": []} if skip else {}
        return options

    def _reserve(
        self,
        run_id: str,
        tool_name: str,
        tool_class: ToolClass,
        args_json: str,
        marker: str,
        on_failure: str,
        push: StepPush | None = None,
    ) -> tuple[int, bool, bool]:
        """The step reserved, whether it is new (False: the marker's earlier step), and
        whether its message was pushed with it (``push``, when its guess held)."""
        gate = rules.gate_for(tool_class)
        for _ in range(_RESERVE_ATTEMPTS):
            outcome = self.store.reserve(
                run_id, tool_name, tool_class, args_json, gate, marker, on_failure, push
            )
            if outcome.status in ("ok", "dup"):
                sent = outcome.status == "ok" and outcome.values[1:] == ("sent",)
                return int(outcome.values[0]), outcome.status == "ok", sent
            if outcome.status == "ended":
                raise RunEndedError(run_id, str(outcome.values[0]))
            view = self.store.view(run_id)
            if outcome.status == "unknown" or view is None:
                raise UnknownRunError(f"no run {run_id}")
            # Refused: say exactly why, from a fresh view (if it moved on meanwhile, retry).
            rules.check_call(view, tool_name, tool_class)
        raise RunContendedError(f"run {run_id} kept changing; call {tool_name} again")
