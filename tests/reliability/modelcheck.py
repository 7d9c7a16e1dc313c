"""A Hypothesis stateful model check of the saga engine, against a real Redis running the real
Lua scripts and the library's real Python code (worker, reaper, engine).

    python -m tests.reliability.modelcheck --examples 2000 --seed 1

Why a model check: the chaos run (``tests.reliability.chaos``) kills real workers at random
points, but the defects that matter sit in *interleavings* (a reaper pass that read a run just
before a worker began its step; a revoke landing on a redelivery; a reply lost after the script
ran). Here there is no Celery worker: the model plays the broker and the workers itself, so
every delivery, crash, redelivery, revoke, reaper pass and injected fault is a rule Hypothesis
chooses, in any order, and a failing sequence shrinks to a short readable program.

How it is driven:

- Every publish of the library (``app.send_task``: a dispatch, an unwind chain, the rest of a
  chain) lands in an in-memory broker the model owns. Celery's own publishes (a retry, the
  tracer sending the next task of a chain) are emulated the way Celery does them.
- A delivery runs the worker's function in a thread; each tool blocks on a gate inside the
  tool, so other actors can act while a step or an undo is "running". The model then lets the
  tool apply its effect, fail, or crash the worker (kill -9: nothing recorded, the message comes
  back) before or after the effect.
- The tools write to a *world ledger*, keyed by idempotency key, that logs every application
  attempt; the invariants are checked against that ledger and against what Redis and SQL say,
  never against the engine's internal fields.

A person asked about a reversal: two tools declare a reversal policy (``book_courier``
always asks, ``refund_fee`` asks when a predicate of its arguments and result says the fee is
costly), so an unwind stops at their undo until a person answers. Rules: a person ``answer``s
a waiting question (reverse, keep with a note, later) with the hash they were shown, another
undo's or none, the store's reply sometimes lost (they answer again); ``answer_again`` (an
answered question, answered once more); ``questions_expire`` (the clock passes every
question's deadline, and a reaper pass, paused or not, expires them); the worker whose undo
asks blocks right after the ask is written (killed there, or revoked, the message comes back);
faults: the reply of the begin that asks, or of an answer taken (a person's or the reaper's
expiry), is lost; the worker that writes a run's conclusion dies right after it (the
library's ``after_conclusion`` fault point).

Every touch-point on the library sits in the adapter section right below (``Engine`` and
``build_registry``): the rest of the file reasons about the world, the broker and the two
pictures (Redis state, SQL records) only.

The CLI keeps going after a violation: each violation is reported with its shrunk program
(Hypothesis's, then minimized further by replaying it without each step in turn: Hypothesis's
shrinker leaves no-op steps in these programs), then masked (its symptom together with the
faults that touched the run; any violation whose run saw at least those faults is taken as the
same defect) and the search goes on with the remaining example budget, so one defect does not
hide the others. ``--stop-first`` stops at the first; ``--only SYMPTOM[+FAULT,...]`` counts
only that violation (to measure how many examples one defect needs). Its last line is
``modelcheck: N examples, V violations`` (N: examples generated, shrinking replays not
counted; V: distinct violations found); the exit status is 1 when V > 0. ``--jobs J`` runs J
copies side by side (seeds ``S*100+j``, each its share of the examples) and sums them. Each
process starts a private redis-server of its own, unless ``SAGA_MODELCHECK_REDIS_URL`` names
one already running (private to the check: its DB 0 is flushed before every example; one job).

Symptoms (each an exception class ``Violation_<symptom>``): ``stuck-<state>``,
``stalled-without-reaper`` (an unwind only the reaper could end although no message of the run
was lost), ``sql-disagrees``, ``unrecorded`` (an ended run whose keys never say recorded),
``escalated-without-open-escalation``,
``open-escalation-after-end``, ``live-in-compensated-run``, ``irreversible-in-compensated-run``,
``live-not-escalated``, ``undone-in-completed-run``, ``undo-of-nothing``, ``undone-twice``,
``undo-order``, ``one-call-applied-twice``, ``concurrent-{forward,undo}-{same-task,
distinct-tasks}``, ``requeue-did-not-compensate`` / ``requeue-ran-no-undo`` (a requeue with
the compensations healthy must compensate), ``exception:<entry point>:<type>`` and ``hang``.
About a person's answers: ``undo-below-asked`` (an older undo ran while a newer one waited
for an answer), ``wrong-hash-taken`` / ``second-answer-taken`` / ``answer-refused`` (an
answer with a stale or no hash, or a second answer, taken; the right one refused),
``refused-answer-changed-run``, ``{reverse,keep}-not-taken`` and ``later-not-asked-again``
(right after an answer); at the end: ``kept-not-resolved`` (a run ended kept on purpose with
its escalation open), ``kept-not-listed``, ``kept-silently`` (kept with no person's keep),
``kept-but-undone``, ``keep-not-kept`` / ``reverse-not-reversed``, ``done-but-live``,
``unanswered-not-escalated`` (an expired question not named by an open escalation),
``sql-disagrees-undo`` (an undo's state or answers differ between Redis and SQL).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import enum
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import hypothesis
import sqlalchemy.exc
from celery import Celery
from celery.canvas import signature
from celery.exceptions import Ignore, Retry
from celery.result import AsyncResult
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    precondition,
    rule,
)
from kombu.exceptions import OperationalError as BrokerError

from saga import (
    NonRetryableToolError,
    RetryPolicy,
    Saga,
    SagaError,
    Settings,
    StepContext,
    StoreUnavailableError,
    ToolClass,
    ToolRegistry,
    Undo,
)
from saga.constants import CONCLUDE_UNWIND_TASK, TOOL_TASK_PREFIX
from saga.errors import OperationRefusedError, UnknownRunError
from saga.rules import REASON_KEPT
from saga.testing import RedisServer

try:
    from saga.compensation import compensate
    from saga.forward import run_step
    from saga.revoke import on_revoked
except ImportError:  # older code, from before the worker's split: all three in saga.worker
    from saga.worker import _compensate as compensate
    from saga.worker import _forward as run_step
    from saga.worker import _on_revoked as on_revoked

# =============================================================================================
# Adapter: every touch-point on the saga library. The engine's internals are being rewritten;
# only this section should need to follow. Everything below it talks to ``Engine`` and to the
# tools declared in ``build_registry``.
# =============================================================================================
# The saga imports at the top of the file are used in this section only.

#: Celery's hard time limit: the reaper spares a step that started less than this (plus its
#: margin) ago.
TASK_TIME_LIMIT = 300.0
#: Seconds without progress before the reaper resolves a run (the run's deadline).
RUN_DEADLINE = 100
#: A worker's patience with an unreachable store: small, so a lost reply costs one retry.
OUTAGE_PATIENCE = 0.05
#: Longer than any example, so an ended run's keys are still there when it is checked.
RETENTION_SECONDS = 3600
#: Deliveries past a tool's retries before a step is taken to be crash-looping. 0 (a valid
#: setting; the default is 2): two crashes put a step in doubt, so in-doubt paths come up
#: often, and an attempt counter a requeue fails to reset shows on the first requeue.
MAX_REDELIVERIES = 0
#: Celery's ``max_retries`` of ``saga.conclude_unwind``.
CONCLUDE_MAX_RETRIES = 20
#: Clock offsets (seconds past now) the reaper may be run at: nothing due; past the run's
#: deadline but within the task time limit; past the time limit; far in the future.
CLOCKS: dict[str, float] = {
    "now": 0.0,
    "past_deadline": RUN_DEADLINE + 10.0,
    "past_time_limit": TASK_TIME_LIMIT + 60.0,
    "far_future": 1e6,
}
#: The calls the model's agent makes: tool name -> arguments (one tool per class, 1 to 5).
AGENT_CALLS: dict[str, dict[str, Any]] = {
    "issue_credit": {"amount": 25},  # class 4, compensation reverse_credit, lookup
    "hold_stock": {"sku": "sku-1"},  # class 3, compensation release_stock, no lookup
    "set_flag": {"flag": "vip"},  # class 2
    "read_order": {"order_id": 7},  # class 1
    "send_mail": {"to": "a@example.com"},  # class 5
}
#: The calls whose undo may ask a person first (a tool's ``reversal`` policy): tool name ->
#: arguments. Apart from ``AGENT_CALLS`` so the hosted check's agent is not offered them.
ASKING_CALLS: dict[str, dict[str, Any]] = {
    "book_courier": {"parcel": "p-1"},  # class 3, compensation cancel_courier, reversal="ask"
    "refund_fee": {"cents": 40},  # class 4, lookup, reversal: a predicate (a costly fee asks)
}
CALLS: dict[str, dict[str, Any]] = {**AGENT_CALLS, **ASKING_CALLS}
#: Attempts of every tool (forward and compensation), so retries stay short.
ATTEMPTS = 2
#: How long a person has to answer a question about a reversal (``reversal_ask_seconds``), and
#: how long "later" puts it off: past the task time limit (a reaper pass at ``past_time_limit``
#: leaves a question alone), within ``far_future`` (a pass then expires every question).
REVERSAL_ASK_SECONDS = 7200
#: A refunded fee above this many cents asks a person before it is reversed (``refund_fee``'s
#: result is its cents times the step number plus one: steps 0 and 1 do not ask, later ones do).
COSTLY_FEE = 100


@dataclass(frozen=True)
class Published:
    """One message as the broker receives it."""

    name: str
    kwargs: dict[str, Any]
    task_id: str
    #: The rest of the chain, as Celery carries it (last element = next task), JSON form.
    chain: list[dict[str, Any]]
    countdown: float | None
    root_id: str


@dataclass(frozen=True)
class MessageInfo:
    """What the model needs to know about a message: whose it is and what it does."""

    run_id: str
    kind: str  # "step" | "undo" | "conclude" | "other"
    step: int | None
    tool: str


@dataclass(frozen=True)
class EscalationView:
    """An open escalation row, as a person reads it."""

    live_steps: frozenset[int]
    failed_steps: frozenset[int]
    reason: str
    resolved: bool = False
    #: The live steps the row says a person kept on purpose.
    kept_steps: frozenset[int] = frozenset()
    #: (step, error type) of each failed compensation it lists ("NotAnswered": nobody answered).
    failed_errors: frozenset[tuple[int, str]] = frozenset()


@dataclass(frozen=True)
class UndoView:
    """One compensation as Redis (or its SQL record) holds it."""

    state: str
    #: Each answer about reversing it, oldest first: (decision, by).
    decisions: tuple[tuple[str, str], ...]
    error_type: str
    #: While asked: the hash an answer must carry.
    ask_hash: str = ""
    ask_expires: float | None = None
    #: Its tool's reversal policy asks, and no person has said "reverse" yet.
    would_ask: bool = False


class EngineHooks(Protocol):
    """What the adapter asks the model while the library runs."""

    def publish(self, message: Published) -> None:
        """Take a library publish (may raise the broker's error, as a refused publish)."""

    def lose_reply(self, script: str, run_id: str) -> bool:
        """True: this store script runs on the server, its reply is lost on the way back."""

    def after_read(self, run_id: str) -> None:
        """The library has just read a run's whole picture (the reaper pauses here)."""

    def records_down(self, run_id: str) -> bool:
        """True while the records database is unreachable (``run_id``: whose record)."""

    def after_script(self, script: str, run_id: str, status: str) -> bool:
        """A store script has run and answered ``status``: True to lose its reply now (the
        caller sees the store away); a worker may also die here (``WorkerCrash``)."""

    def strike(self, point: str) -> None:
        """A fault point of the library (``saga.fault_points``): a worker may die here."""


class WorldTools(Protocol):
    """The world the tools act on (implemented by ``World`` below)."""

    def forward(
        self, run_id: str, step: int, key: str, tool: str, klass: int, result: dict[str, Any]
    ) -> dict[str, Any]: ...

    def undo(self, run_id: str, step: int, key: str, tool: str, target: str) -> dict[str, Any]: ...

    def lookup(self, key: str) -> dict[str, Any] | None: ...


def build_registry(world: WorldTools) -> ToolRegistry:
    """The tools of ``AGENT_CALLS`` and their compensations, acting on ``world``."""
    tools = ToolRegistry()
    retry = RetryPolicy(attempts=ATTEMPTS, backoff=0.0, jitter=False)

    def lookup(key: str, args: dict[str, Any]) -> Any:
        return world.lookup(key)

    @tools.tool(
        ToolClass.COMPENSATABLE_WRITE,
        compensation=lambda args, result: Undo(
            "reverse_credit", {"credit_id": result["credit_id"]}
        ),
        lookup=lookup,
        retry=retry,
    )
    def issue_credit(ctx: StepContext, amount: int) -> dict[str, Any]:
        result = {"credit_id": ctx.idempotency_key, "amount": amount}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "issue_credit", 4, result)

    @tools.compensation(retry=retry)
    def reverse_credit(ctx: StepContext, credit_id: str) -> dict[str, Any]:
        return world.undo(ctx.run_id, ctx.step, ctx.idempotency_key, "reverse_credit", credit_id)

    @tools.tool(
        ToolClass.REVERSIBLE_WRITE,
        compensation=lambda args, result: Undo("release_stock", {"hold_id": result["hold_id"]}),
        retry=retry,
    )
    def hold_stock(ctx: StepContext, sku: str) -> dict[str, Any]:
        result = {"hold_id": ctx.idempotency_key, "sku": sku}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "hold_stock", 3, result)

    @tools.compensation(retry=retry)
    def release_stock(ctx: StepContext, hold_id: str) -> dict[str, Any]:
        return world.undo(ctx.run_id, ctx.step, ctx.idempotency_key, "release_stock", hold_id)

    @tools.tool(ToolClass.CONVERGENT_WRITE, retry=retry)
    def set_flag(ctx: StepContext, flag: str) -> dict[str, Any]:
        result = {"flag": flag}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "set_flag", 2, result)

    @tools.tool(ToolClass.READ, retry=retry)
    def read_order(ctx: StepContext, order_id: int) -> dict[str, Any]:
        result = {"order_id": order_id, "status": "paid"}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "read_order", 1, result)

    @tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=retry)
    def send_mail(ctx: StepContext, to: str) -> dict[str, Any]:
        result = {"sent_to": to}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "send_mail", 5, result)

    # The tools whose undo asks a person first (``ASKING_CALLS``).
    @tools.tool(
        ToolClass.REVERSIBLE_WRITE,
        compensation=lambda args, result: Undo(
            "cancel_courier", {"booking_id": result["booking_id"]}
        ),
        retry=retry,
        reversal="ask",
    )
    def book_courier(ctx: StepContext, parcel: str) -> dict[str, Any]:
        result = {"booking_id": ctx.idempotency_key, "parcel": parcel}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "book_courier", 3, result)

    @tools.compensation(retry=retry)
    def cancel_courier(ctx: StepContext, booking_id: str) -> dict[str, Any]:
        return world.undo(ctx.run_id, ctx.step, ctx.idempotency_key, "cancel_courier", booking_id)

    def costly(args: dict[str, Any], result: Any) -> bool:
        return int(args["cents"]) > 0 and int(result["cents"]) > COSTLY_FEE

    @tools.tool(
        ToolClass.COMPENSATABLE_WRITE,
        compensation=lambda args, result: Undo("restore_fee", {"fee_id": result["fee_id"]}),
        lookup=lookup,
        retry=retry,
        reversal=costly,
    )
    def refund_fee(ctx: StepContext, cents: int) -> dict[str, Any]:
        result = {"fee_id": ctx.idempotency_key, "cents": cents * (ctx.step + 1)}
        return world.forward(ctx.run_id, ctx.step, ctx.idempotency_key, "refund_fee", 4, result)

    @tools.compensation(retry=retry)
    def restore_fee(ctx: StepContext, fee_id: str) -> dict[str, Any]:
        return world.undo(ctx.run_id, ctx.step, ctx.idempotency_key, "restore_fee", fee_id)

    return tools


def is_documented(exc: BaseException) -> bool:
    """An error the library documents (its entry points may raise these)."""
    return isinstance(exc, SagaError)


def agent_retries(exc: BaseException) -> bool:
    """An error the library marks retryable: an agent calls again (DispatchError, ...)."""
    return isinstance(exc, SagaError) and bool(exc.retryable)


def is_records_outage(exc: BaseException) -> bool:
    return isinstance(exc, sqlalchemy.exc.OperationalError)


def final_tool_error(message: str) -> Exception:
    """What a tool raises to fail at once, without retries."""
    return NonRetryableToolError(message)


def answer_refused(exc: BaseException) -> bool:
    """The library refused a person's answer about a reversal (and changed nothing)."""
    return isinstance(exc, OperationRefusedError | UnknownRunError)


def kept_on_purpose(reason: str) -> bool:
    """A run's reason when every undo not done was kept on purpose by a person."""
    return reason == REASON_KEPT


class Strikes:
    """``saga.faults`` for the model: each fault point the library reaches asks the model."""

    def __init__(self, hooks: EngineHooks) -> None:
        self.hooks = hooks

    def strike(self, point: str, name: str) -> None:
        self.hooks.strike(point)


class Engine:
    """The library, wired for the model: its publishes, its store calls, its records and its
    reaper's reads all pass through ``hooks``."""

    def __init__(self, redis_url: str, database_url: str, world: WorldTools, hooks: EngineHooks):
        self.hooks = hooks
        # The broker URL names the private Redis (DB 1), but nothing is ever published to it:
        # ``send_task`` is replaced below, and every publish (a task's ``apply_async``, a
        # chain's) ends in ``app.send_task``.
        app = Celery("modelcheck", broker=f"{redis_url}/1", backend=None)
        app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            task_acks_late=True,
            task_reject_on_worker_lost=True,
            task_time_limit=TASK_TIME_LIMIT,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
        )
        self.app = app
        options: dict[str, Any] = {
            "redis_url": f"{redis_url}/0",
            "database_url": database_url,
            "retention_seconds": RETENTION_SECONDS,
            "run_deadline_seconds": RUN_DEADLINE,
            "store_outage_patience": OUTAGE_PATIENCE,
            "max_redeliveries": MAX_REDELIVERIES,
            "reversal_ask_seconds": REVERSAL_ASK_SECONDS,
        }
        settings_ = Settings(**{**options, **self.settings_overrides()})
        self.saga = Saga(app, build_registry(world), settings_)
        # The library's fault points (``saga.fault_points``) ask the model (a sibling check
        # may put its own in place).
        self.saga.faults = Strikes(hooks)  # type: ignore[assignment]
        #: What the worker's functions take: the run transitions (on older code, the ``Saga``).
        self.core: Any = getattr(self.saga, "core", self.saga)
        app.send_task = self._send_task  # type: ignore[method-assign]
        store = self.saga.store
        self._real_call = store._call
        self._real_picture = store.picture
        store._call = self._call  # type: ignore[method-assign]
        store.picture = self._picture  # type: ignore[method-assign]
        if hasattr(store, "_call_and_read"):  # a script and a reading in one round trip
            self._real_call_and_read = store._call_and_read
            store._call_and_read = self._call_and_read  # type: ignore[method-assign]
        elif hasattr(store, "complete"):  # older code concludes through ``_call``
            self._real_complete = store.complete
            store.complete = self._complete  # type: ignore[method-assign]
        records = self.saga.records
        self._read_run = records.run
        self._read_escalations = records.escalations
        for name in ("record_outcome", "record_unreadable", "resolve_escalations"):
            if hasattr(records, name):
                setattr(records, name, self._guarded(name, getattr(records, name)))

    def settings_overrides(self) -> dict[str, Any]:
        """Settings a sibling check (``modelcheck_hosted``) changes for its own engine."""
        return {}

    # -- interception ------------------------------------------------------------------------

    def _send_task(
        self,
        name: str,
        args: Any = None,
        kwargs: dict[str, Any] | None = None,
        countdown: float | None = None,
        eta: Any = None,
        task_id: str | None = None,
        chain: list[Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        import json
        import uuid

        task_id = task_id or str(uuid.uuid4())
        message = Published(
            name=name,
            kwargs=dict(kwargs or {}),
            task_id=task_id,
            chain=json.loads(json.dumps(chain or [])),
            countdown=countdown,
            root_id=str(options.get("root_id") or task_id),
        )
        self.hooks.publish(message)
        return AsyncResult(task_id, app=self.app)

    def _call(
        self, script: str, run_id: str, *args: Any, step: int | None = None, extra: str = ""
    ) -> Any:
        if self.hooks.lose_reply(script, run_id):
            self._real_call(script, run_id, *args, step=step, extra=extra)
            raise StoreUnavailableError(f"saga store unreachable ({script}): the reply was lost")
        outcome = self._real_call(script, run_id, *args, step=step, extra=extra)
        if self.hooks.after_script(script, run_id, str(getattr(outcome, "status", ""))):
            raise StoreUnavailableError(f"saga store unreachable ({script}): the reply was lost")
        return outcome

    def _call_and_read(
        self, script: str, run_id: str, args: Any, extra: Any = ()
    ) -> tuple[Any, Any]:
        """A script and the whole run read back in one transaction (the caller's conclusion,
        a step's final failure, the last undo's outcome): its reply may be lost like any
        script's; answered, it is a script that ran (``after_script``) and a reading like
        ``picture``'s."""
        if self.hooks.lose_reply(script, run_id):
            self._real_call_and_read(script, run_id, args, extra)
            raise StoreUnavailableError(f"saga store unreachable ({script}): the reply was lost")
        outcome, picture = self._real_call_and_read(script, run_id, args, extra)
        if self.hooks.after_script(script, run_id, str(getattr(outcome, "status", ""))):
            raise StoreUnavailableError(f"saga store unreachable ({script}): the reply was lost")
        self.hooks.after_read(run_id)
        return outcome, picture

    def _complete(self, run_id: str) -> Any:
        """The conclude script and the read after it are one round trip: its reply may be
        lost like any script's, and the read is a reading like ``picture``'s."""
        if self.hooks.lose_reply("conclude", run_id):
            self._real_complete(run_id)
            raise StoreUnavailableError("saga store unreachable (conclude): the reply was lost")
        outcome = self._real_complete(run_id)
        self.hooks.after_read(run_id)
        return outcome

    def _picture(self, run_id: str) -> Any:
        picture = self._real_picture(run_id)
        self.hooks.after_read(run_id)
        return picture

    def _guarded(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            subject = args[0] if args else kwargs.get("picture", kwargs.get("run_id"))
            run_id = subject if isinstance(subject, str) else str(getattr(subject, "run_id", ""))
            if self.hooks.records_down(run_id):
                raise sqlalchemy.exc.OperationalError(
                    f"{name} (model)", None, ConnectionError("the records database is down")
                )
            return method(*args, **kwargs)

        return guarded

    # -- entry points --------------------------------------------------------------------------

    def reset(self) -> None:
        """A clean Redis for the next example (run ids are unique, so SQL rows never clash)."""
        self.saga.store.client.flushdb()

    def new_run(self, label: str) -> str:
        import uuid

        return self.saga.start_run(f"{label}-{uuid.uuid4().hex[:10]}").run_id

    def dispatch(self, run_id: str, tool: str) -> None:
        self.saga.dispatch(run_id, tool, dict(CALLS[tool]))

    def decide(self, run_id: str, step: int, decision: str, shown: str, note: str) -> None:
        """A person's answer about reversing step ``step`` (``Saga.decide_reversal``), with the
        hash of the undo they were shown."""
        self.saga.decide_reversal(run_id, step, decision, args_hash=shown, by="model", note=note)

    def abort(self, run_id: str) -> None:
        self.saga.abort(run_id, "the agent gave up")

    def complete(self, run_id: str) -> None:
        self.saga.complete(run_id)

    def requeue(self, run_id: str) -> int:
        return self.saga.requeue_failed_compensations(run_id)

    def conclude(self, kwargs: dict[str, Any]) -> None:
        """What ``saga.conclude_unwind`` does with its message."""
        self.core.conclude(kwargs["run_id"], kwargs.get("owner", ""))

    def deliver(self, name: str, kwargs: dict[str, Any], task: Any) -> Any:
        """What ``tools.<name>`` does with its message, run by a worker."""
        tool = self.saga.registry.get(name[len(TOOL_TASK_PREFIX) :])
        run_id = kwargs["run_id"]
        if kwargs.get("compensates") is not None:
            unwind = kwargs.get("unwind", "")
            return compensate(self.core, task, tool, run_id, int(kwargs["compensates"]), unwind)
        return run_step(
            self.core, task, tool, run_id, int(kwargs["step"]), kwargs.get("args") or {}
        )

    def revoked(self, message: Published, terminated: bool) -> None:
        """Celery's ``task_revoked`` signal for ``message``."""
        request = SimpleNamespace(
            kwargs=message.kwargs,
            name=message.name,
            chain=list(message.chain),
            id=message.task_id,
            root_id=message.root_id,
        )
        on_revoked(self.core, request, terminated)

    def lease_ran_out(self, info: MessageInfo, alive: frozenset[str] = frozenset()) -> None:
        """The delivery of this step or undo died and its message comes back only after the
        visibility timeout: by then its lease (Redis clock) has run out. Not the lease of a
        copy of the message still running (``alive``: the task ids of running deliveries): a
        duplicate may have begun later, and its lease outlasts the restore."""
        from saga.constants import run_keys

        if info.step is None or info.kind not in ("step", "undo"):
            return
        key = run_keys(info.run_id)[1 if info.kind == "step" else 4]
        claim = self.saga.store.client.hget(key, f"{info.step}:claim") or ""
        if claim.split("/", 1)[0] in alive:
            return
        if self.saga.store.client.hexists(key, f"{info.step}:lease"):
            self.saga.store.client.hset(key, f"{info.step}:lease", "0")

    def dead_lease_ran_out(self, info: MessageInfo, task_id: str, alive: set[str]) -> None:
        """A delivery killed for good (after a terminate-revoke or the time limit: acked, never
        back) holds its lease until the Redis clock passes it, which the model cannot move: it
        lets that lease run out now, unless a delivery of the same message is still alive."""
        from saga.constants import run_keys

        if info.step is None or info.kind not in ("step", "undo") or task_id in alive:
            return
        key = run_keys(info.run_id)[1 if info.kind == "step" else 4]
        claim = self.saga.store.client.hget(key, f"{info.step}:claim") or ""
        if claim.startswith(f"{task_id}/"):
            self.saga.store.client.hset(key, f"{info.step}:lease", "0")

    def _all_leases_ran_out(self) -> None:
        """The Redis clock moved past every task time limit: every lease has run out."""
        client = self.saga.store.client
        for key in client.scan_iter(match="saga:*"):
            if key.endswith((":steps", ":comps")):
                for field in client.hkeys(key):
                    if field.endswith(":lease"):
                        client.hset(key, field, "0")

    def _all_questions_expired(self) -> None:
        """The Redis clock moved past every question's deadline (``reversal_ask_seconds``, or
        the one "later" set): the decide script compares it with its own clock."""
        client = self.saga.store.client
        for key in client.scan_iter(match="saga:*:comps"):
            for name in client.hkeys(key):
                if name.endswith(":ask_expires"):
                    client.hset(key, name, "0")

    def reap(self, now: float) -> dict[str, list[str]]:
        """One reaper pass at clock ``now``; what it did, per run. A clock past the task time
        limit is past every delivery's lease too (the leases live on the Redis clock, which the
        model cannot move: it expires them instead)."""
        if now - time.time() >= TASK_TIME_LIMIT:
            self._all_leases_ran_out()
        if now - time.time() >= REVERSAL_ASK_SECONDS:
            self._all_questions_expired()
        report = self.saga.reap(now=now)
        done: dict[str, list[str]] = {}
        for run_id, _step in getattr(report, "unanswered", ()):
            done.setdefault(run_id, []).append("reaper-unanswered")
        for run_id in report.abandoned:
            done.setdefault(run_id, []).append("reaper-abandoned")
        for run_id, _step in report.never_started:
            done.setdefault(run_id, []).append("reaper-never-started")
        for run_id, _step in report.resent:
            done.setdefault(run_id, []).append("reaper-resent")
        for run_id, _step, _verdict in report.in_doubt:
            done.setdefault(run_id, []).append("reaper-in-doubt")
        for run_id in report.resumed:
            done.setdefault(run_id, []).append("reaper-took-over")
        return done

    # -- what the model reads ------------------------------------------------------------------

    @staticmethod
    def describe(name: str, kwargs: dict[str, Any]) -> MessageInfo:
        run_id = str(kwargs.get("run_id", ""))
        if name == CONCLUDE_UNWIND_TASK:
            return MessageInfo(run_id, "conclude", None, "")
        if not name.startswith(TOOL_TASK_PREFIX):
            return MessageInfo(run_id, "other", None, "")
        tool = name[len(TOOL_TASK_PREFIX) :]
        if kwargs.get("compensates") is not None:
            return MessageInfo(run_id, "undo", int(kwargs["compensates"]), tool)
        return MessageInfo(run_id, "step", int(kwargs["step"]), tool)

    def doubt_unresolved(self, run_id: str) -> bool:
        """A step of the run is in doubt with nothing that can tell (a person must look: a
        requeue of its undos cannot end the run compensated)."""
        picture = self._real_picture(run_id)
        return picture is not None and any(s.state.value == "in_doubt" for s in picture.steps)

    def redis_state(self, run_id: str) -> str | None:
        picture = self._real_picture(run_id)
        return None if picture is None else str(picture.state.value)

    def redis_recorded(self, run_id: str) -> bool:
        """Whether the run's keys say its end is in SQL (not only some earlier record)."""
        picture = self._real_picture(run_id)
        return picture is not None and picture.recorded

    def sql_state(self, run_id: str) -> str | None:
        record = self._read_run(run_id)
        return None if record is None else str(record.state)

    def open_escalations(self, run_id: str) -> list[EscalationView]:
        return self.escalations(run_id, open_only=True)

    def escalations(self, run_id: str, open_only: bool = False) -> list[EscalationView]:
        """The run's escalation rows, oldest first."""
        return [
            EscalationView(
                live_steps=frozenset(int(item["step"]) for item in row.not_undone),
                failed_steps=frozenset(int(item["step"]) for item in row.failed_compensations),
                reason=str(row.reason),
                resolved=bool(row.resolved),
                kept_steps=frozenset(
                    int(item["step"])
                    for item in row.not_undone
                    if str(item.get("why", "")).startswith("kept on purpose")
                ),
                failed_errors=frozenset(
                    (int(item["step"]), str((item.get("error") or {}).get("type", "")))
                    for item in row.failed_compensations
                ),
            )
            for row in self._read_escalations(run_id, open_only=open_only)
        ]

    def redis_reason(self, run_id: str) -> str:
        picture = self._real_picture(run_id)
        return "" if picture is None else str(picture.reason)

    @staticmethod
    def _undo_view(c: Any) -> UndoView:
        decisions = tuple(
            (str(d.get("decision", "")), str(d.get("by", ""))) for d in c.decisions or []
        )
        entry = c.entry if isinstance(c.entry, dict) else {}
        approved = any(d == "reverse" for d, _ in decisions)
        return UndoView(
            state=str(getattr(c.state, "value", c.state)),
            decisions=decisions,
            error_type=str((c.error or {}).get("type", "")),
            ask_hash=str(getattr(c, "ask_hash", "") or ""),
            ask_expires=getattr(c, "ask_expires", None),
            would_ask=bool(entry.get("ask")) and not approved,
        )

    def undos(self, run_id: str) -> dict[int, UndoView]:
        """The run's compensations in Redis, by step."""
        picture = self._real_picture(run_id)
        if picture is None:
            return {}
        return {c.step: self._undo_view(c) for c in picture.compensations}

    def sql_undos(self, run_id: str) -> dict[int, UndoView]:
        """The run's compensations in its SQL record, by step."""
        return {
            c.step: UndoView(
                state=str(c.state),
                decisions=tuple(
                    (str(d.get("decision", "")), str(d.get("by", ""))) for d in c.decisions or []
                ),
                error_type=str((c.error or {}).get("type", "")),
            )
            for c in self.saga.records.compensations(run_id)
        }

    def asked_steps(self, run_id: str) -> set[int]:
        """The steps whose undo waits for a person's answer, read straight from Redis (a
        worker thread asks this while its undo runs)."""
        from saga.constants import run_keys

        fields = self.saga.store.client.hgetall(run_keys(run_id)[4])
        return {
            int(name.split(":", 1)[0])
            for name, value in fields.items()
            if name.endswith(":state") and value == "asked"
        }

    def snapshot(self, run_id: str) -> tuple[Any, ...]:
        """Everything the run's keys hold (what a refused answer must leave as it was)."""
        from saga.constants import run_keys

        client = self.saga.store.client
        held: list[Any] = []
        for key in run_keys(run_id):
            kind = client.type(key)
            if kind == "hash":
                held.append(sorted(client.hgetall(key).items()))
            elif kind == "list":
                held.append(client.lrange(key, 0, -1))
            else:
                held.append(kind)
        return tuple(map(str, held))

    def close(self) -> None:
        self.saga.store.client.close()
        self.saga.records.dispose()


# =============================================================================================
# The world: what the tools did, keyed by idempotency key, every attempt logged.
# =============================================================================================

#: How long the model waits for a thread to block in a tool or finish (a longer wait is a hang).
WAIT_SECONDS = 15.0


class Command(enum.Enum):
    """What a tool blocked at its gate is told to do."""

    PROCEED = "proceed"
    FAIL = "fail"  # a retryable failure, before any effect
    FAIL_FINAL = "fail_final"  # a failure the tool declares final, before any effect
    CRASH_BEFORE = "crash_before"  # kill -9 before the effect
    CRASH_AFTER = "crash_after"  # kill -9 after the effect, before anything is recorded


class WorkerCrash(BaseException):
    """The pool process dies (kill -9): no ``except Exception`` in the library sees it, nothing
    is recorded, and the message goes back to the broker."""


class ToolDown(Exception):
    """The system behind a tool fails, before any effect (a 503): retryable."""

    retryable = True


@dataclass
class Effect:
    """A forward effect in the world, and its undo if one ran."""

    key: str
    run_id: str
    step: int
    tool: str
    klass: int
    #: The agent call that made the step (None if unknown).
    call: int | None
    seq: int
    result: dict[str, Any]
    undone_by: str | None = None
    undo_seq: int | None = None
    #: The unwind round (the chain's root task id) whose undo took it back.
    undo_round: str = ""


@dataclass(frozen=True)
class Finding:
    """A violation seen while the model ran: a symptom, the run it concerns, and what broke."""

    symptom: str
    run_id: str
    message: str


class World:
    """The systems behind the tools. Effects apply idempotently by key (a repeat returns the
    effect already applied), but every attempt is checked: a second effect for one agent call,
    an undo of something never applied, an undo twice, undos out of order, or two executions of
    the same key at once are findings."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        self.effects: dict[str, Effect] = {}
        self.undos: dict[str, str] = {}  # undo key -> target effect key
        self.executing: dict[str, list[Delivery]] = {}
        self.findings: list[Finding] = []
        #: The next this-many undo calls (any compensation tool) fail, retryably.
        self.undo_failures = 0
        self.call_of_step: dict[tuple[str, int], int] = {}
        #: Runs whose undo the world failed on purpose (``undo_failures``).
        self.failed_undo_runs: set[str] = set()
        #: Calls of an undo tool per run (failed, crashed or applied).
        self.undo_calls: dict[str, int] = {}
        self.seq = 0
        #: The steps of a run whose undo waits for a person's answer (Redis, read as an undo
        #: begins): set by the state machine.
        self.asked_probe: Callable[[str], set[int]] | None = None

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    # -- tools -------------------------------------------------------------------------------

    def forward(
        self, run_id: str, step: int, key: str, tool: str, klass: int, result: dict[str, Any]
    ) -> dict[str, Any]:
        delivery = current_delivery()
        self._enter(key, run_id, delivery, "forward")
        try:
            command = delivery.gate() if delivery is not None else Command.PROCEED
            if command is Command.CRASH_BEFORE:
                raise WorkerCrash(f"{tool} killed before its effect")
            if command is Command.FAIL:
                raise ToolDown(f"{tool}: the system is down (model)")
            if command is Command.FAIL_FINAL:
                raise final_tool_error(f"{tool}: refused for good (model)")
            applied = self._apply(run_id, step, key, tool, klass, result)
            if command is Command.CRASH_AFTER:
                raise WorkerCrash(f"{tool} killed after its effect")
            return applied
        finally:
            self._exit(key, delivery)

    def undo(self, run_id: str, step: int, key: str, tool: str, target: str) -> dict[str, Any]:
        delivery = current_delivery()
        with self.lock:
            self.undo_calls[run_id] = self.undo_calls.get(run_id, 0) + 1
        asked = sorted(
            s for s in (self.asked_probe(run_id) if self.asked_probe else ()) if s > step
        )
        if asked:
            with self.lock:
                self.findings.append(
                    Finding(
                        "undo-below-asked",
                        run_id,
                        f"{tool} undoes step {step} while a person is still asked about the "
                        f"undo of newer step(s) {asked}",
                    )
                )
        self._enter(key, run_id, delivery, "undo")
        try:
            command = delivery.gate() if delivery is not None else Command.PROCEED
            if command is Command.CRASH_BEFORE:
                raise WorkerCrash(f"{tool} killed before its effect")
            with self.lock:
                failing = self.undo_failures
                if failing > 0:
                    self.undo_failures = failing - 1
                if failing > 0:
                    self.failed_undo_runs.add(run_id)
            if failing > 0 or command is Command.FAIL:
                raise ToolDown(f"{tool}: the system is down (model)")
            if command is Command.FAIL_FINAL:
                raise final_tool_error(f"{tool}: refused for good (model)")
            round_id = delivery.message.root_id if delivery is not None else ""
            self._apply_undo(run_id, step, key, tool, target, round_id)
            if command is Command.CRASH_AFTER:
                raise WorkerCrash(f"{tool} killed after its effect")
            return {"undone": target}
        finally:
            self._exit(key, delivery)

    def lookup(self, key: str) -> dict[str, Any] | None:
        with self.lock:
            effect = self.effects.get(key)
            return None if effect is None else dict(effect.result)

    # -- bookkeeping -------------------------------------------------------------------------

    def _enter(self, key: str, run_id: str, delivery: Delivery | None, what: str) -> None:
        with self.lock:
            running = self.executing.setdefault(key, [])
            for other in running:
                same = delivery is not None and other.message.task_id == delivery.message.task_id
                how = "one task delivered twice" if same else "two distinct tasks"
                symptom = f"concurrent-{what}-{'same-task' if same else 'distinct-tasks'}"
                self.findings.append(
                    Finding(symptom, run_id, f"{key} runs twice at once ({how}): {what}")
                )
            if delivery is not None:
                running.append(delivery)

    def _exit(self, key: str, delivery: Delivery | None) -> None:
        with self.lock:
            running = self.executing.get(key, [])
            if delivery in running:
                running.remove(delivery)

    def _apply(
        self, run_id: str, step: int, key: str, tool: str, klass: int, result: dict[str, Any]
    ) -> dict[str, Any]:
        with self.lock:
            if klass == 1:
                return dict(result)  # a read: nothing applied
            existing = self.effects.get(key)
            if existing is not None:
                return dict(existing.result)  # an idempotent repeat
            call = self.call_of_step.get((run_id, step))
            for other in self.effects.values():
                if call is not None and other.run_id == run_id and other.call == call:
                    self.findings.append(
                        Finding(
                            "one-call-applied-twice",
                            run_id,
                            f"agent call #{call} applied twice: step {other.step} and step "
                            f"{step} ({tool}) both took effect",
                        )
                    )
            self.effects[key] = Effect(key, run_id, step, tool, klass, call, self._next(), result)
            return dict(result)

    def _apply_undo(
        self, run_id: str, step: int, key: str, tool: str, target: str, round_id: str
    ) -> None:
        with self.lock:
            if key in self.undos:
                return  # an idempotent repeat of the same undo
            self.undos[key] = target
            effect = self.effects.get(target)
            if effect is None:
                self.findings.append(
                    Finding("undo-of-nothing", run_id, f"{tool} undid {target}, never applied")
                )
                return
            if effect.undone_by is not None:
                self.findings.append(
                    Finding(
                        "undone-twice",
                        run_id,
                        f"{target} undone twice: by {effect.undone_by} and by {key}",
                    )
                )
                return
            for other in self.effects.values():
                if (
                    other.run_id == effect.run_id
                    and other.undo_round == round_id
                    and other.undone_by is not None
                    and other.step < effect.step
                ):
                    self.findings.append(
                        Finding(
                            "undo-order",
                            run_id,
                            f"undo of step {effect.step} ran after the undo of older step "
                            f"{other.step} in the same unwind",
                        )
                    )
            effect.undone_by, effect.undo_seq, effect.undo_round = key, self._next(), round_id

    def effects_of(self, run_id: str) -> list[Effect]:
        with self.lock:
            return sorted(
                (e for e in self.effects.values() if e.run_id == run_id), key=lambda e: e.seq
            )


WORLD = World()
_LOCAL = threading.local()


def qualified(exc: BaseException) -> str:
    """``kombu.exceptions.OperationalError``, not just ``OperationalError`` (SQLAlchemy has one)."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]


def current_delivery() -> Delivery | None:
    return getattr(_LOCAL, "delivery", None)


def current_reaper() -> ReaperPass | None:
    return getattr(_LOCAL, "reaper", None)


# =============================================================================================
# The broker and the workers, played by the model.
# =============================================================================================


@dataclass
class Message:
    """A message on the model's broker."""

    seq: int
    published: Published
    info: MessageInfo
    retries: int = 0

    @property
    def task_id(self) -> str:
        return self.published.task_id

    @property
    def root_id(self) -> str:
        return self.published.root_id

    def label(self) -> str:
        info = self.info
        run = info.run_id.split("-")[0]
        if info.kind in ("conclude", "start_unwind"):
            return f"#{self.seq} {info.kind}({run})"
        if info.kind == "turn":
            return f"#{self.seq} turn {info.step}({run})"
        what = "undo" if info.kind == "undo" else "step"
        return f"#{self.seq} {info.tool}({run} {what} {info.step})"


class FakeRequest:
    """``task.request`` as the worker functions read it."""

    def __init__(self, message: Message) -> None:
        self.id = message.task_id
        self.chain: list[dict[str, Any]] | None = [dict(s) for s in message.published.chain]
        self.root_id = message.root_id
        self.retries = message.retries
        self.kwargs = message.published.kwargs
        self.name = message.published.name
        self.called_directly = False
        self.delivery_info: dict[str, Any] = {}


class FakeTask:
    """The bound Celery task: ``retry`` publishes a copy (same id, kwargs and chain), as
    Celery's ``Task.retry`` does, and returns the exception to raise."""

    def __init__(self, app: Any, message: Message, requeue: Callable[[Message], None]) -> None:
        self.app = app
        self.name = message.published.name
        self.request = FakeRequest(message)
        self._message = message
        self._requeue = requeue

    def retry(
        self, exc: BaseException | None = None, countdown: float | None = None, **_: Any
    ) -> Retry:
        self._requeue(self._message)
        return Retry(exc=exc, when=countdown)


class Delivery:
    """One delivery of a tool message, run by a worker thread that blocks in the tool."""

    def __init__(self, number: int, message: Message, task: FakeTask) -> None:
        self.number = number
        self.message = message
        self.task = task
        self.cond = threading.Condition()
        self.phase = "running"  # running | blocked | done
        self.command: Command | None = None
        self.outcome = ""  # returned | ignored | retry | crash | failed
        self.exc: BaseException | None = None
        #: Revoked with terminate=True while running: whatever happens, it is acked.
        self.terminated = False
        self.effect_allowed = True
        self.thread: threading.Thread | None = None
        #: Where it blocks: in the tool, or at a point of the library (after an ask).
        self.where = "in the tool"

    def gate(self, where: str = "in the tool") -> Command:
        """Called by the tool (or at a point of the library): wait for the model's command."""
        with self.cond:
            self.where = where
            self.phase = "blocked"
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.command is not None, WAIT_SECONDS):
                return Command.CRASH_BEFORE  # the model gave up on it (a hang is reported)
            assert self.command is not None
            return self.command

    def wait(self) -> bool:
        """Wait until the thread blocks in the tool or finishes; False on a hang."""
        with self.cond:
            return self.cond.wait_for(lambda: self.phase != "running", WAIT_SECONDS)

    def order(self, command: Command) -> bool:
        """Tell the blocked tool what to do and wait for the delivery to finish."""
        with self.cond:
            self.command = command
            self.phase = "running"
            self.cond.notify_all()
            return self.cond.wait_for(lambda: self.phase == "done", WAIT_SECONDS)


class ReaperPass:
    """A reaper pass in a thread that pauses right after it read one run's picture, so other
    actors can move that run on before the pass acts on what it read."""

    def __init__(self, run_id: str, now: float) -> None:
        self.run_id = run_id
        self.now = now
        self.cond = threading.Condition()
        self.phase = "running"  # running | paused | done
        self.resumed = False
        self.paused_once = False
        self.done: dict[str, list[str]] = {}
        self.exc: BaseException | None = None
        #: How far ahead of the real clock the pass runs.
        self.offset = 0.0

    def after_read(self, run_id: str) -> None:
        if self.paused_once or run_id != self.run_id:
            return
        self.paused_once = True
        with self.cond:
            self.phase = "paused"
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.resumed, WAIT_SECONDS)

    def wait(self) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.phase != "running", WAIT_SECONDS)

    def resume(self) -> bool:
        with self.cond:
            self.resumed = True
            self.phase = "running"
            self.cond.notify_all()
            return self.cond.wait_for(lambda: self.phase == "done", WAIT_SECONDS)


# =============================================================================================
# Violations, masks and the campaign's figures.
# =============================================================================================


class Violation(AssertionError):
    """An invariant broke. One subclass per symptom, so Hypothesis tells symptoms apart."""

    symptom = "violation"

    def __init__(self, message: str, touches: frozenset[str]) -> None:
        super().__init__(message)
        self.touches = touches


_VIOLATION_CLASSES: dict[str, type[Violation]] = {}


def violation_class(symptom: str) -> type[Violation]:
    if symptom not in _VIOLATION_CLASSES:
        name = "Violation_" + re.sub(r"\W", "_", symptom)
        _VIOLATION_CLASSES[symptom] = type(name, (Violation,), {"symptom": symptom})
    return _VIOLATION_CLASSES[symptom]


@dataclass
class Sighting:
    """The first time a symptom was seen with a given set of faults on its run."""

    symptom: str
    touches: frozenset[str]
    message: str
    examples: int
    seconds: float


#: Symptoms masked whatever faults touched the run (see ``Campaign.mask``).
SYMPTOM_ONLY = ("exception:", "concurrent-forward-same-task", "concurrent-undo-same-task", "hang")


@dataclass
class Campaign:
    """Figures across Hypothesis runs: examples generated, what was seen, what is masked."""

    generated: int = 0
    search_seconds: float = 0.0
    round_started: float = 0.0
    round_failed: bool = False
    first_in_round: Sighting | None = None
    masks: dict[str, list[frozenset[str]]] = field(default_factory=dict)
    #: When set (``--only``): the only violations that count, as (symptom, faults it needs).
    targets: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    sightings: dict[tuple[str, frozenset[str]], Sighting] = field(default_factory=dict)

    def start_round(self) -> None:
        self.round_started = time.monotonic()
        self.round_failed = False
        self.first_in_round = None

    def end_round(self) -> None:
        if not self.round_failed:
            self.search_seconds += time.monotonic() - self.round_started

    def example(self) -> None:
        if not self.round_failed:
            self.generated += 1

    def elapsed(self) -> float:
        if self.round_failed:
            return self.search_seconds
        return self.search_seconds + time.monotonic() - self.round_started

    def masked(self, symptom: str, touches: frozenset[str]) -> bool:
        if self.targets and not any(
            symptom == wanted and needed <= touches for wanted, needed in self.targets
        ):
            return True
        return any(mask <= touches for mask in self.masks.get(symptom, []))

    def see(self, symptom: str, touches: frozenset[str], message: str) -> Sighting:
        sighting = Sighting(symptom, touches, message, self.generated, self.elapsed())
        self.sightings.setdefault((symptom, touches), sighting)
        return sighting

    def fail(self, sighting: Sighting) -> None:
        if not self.round_failed:
            self.search_seconds += time.monotonic() - self.round_started
            self.round_failed = True
            self.first_in_round = sighting

    def mask(self, symptom: str, touches: frozenset[str]) -> None:
        """Mask a reported violation: the same symptom on a run with at least the same faults.
        An exception, or one task running twice at once, is masked whatever the faults: its
        symptom names its cause already."""
        if symptom.startswith(SYMPTOM_ONLY):
            touches = frozenset()
        self.masks.setdefault(symptom, []).append(touches)


CAMPAIGN = Campaign()


# =============================================================================================
# Resources: one private redis-server and one Engine per process.
# =============================================================================================


class Switchboard:
    """The engine's hooks, forwarded to the state machine running the current example."""

    machine: ModelCheck | None = None

    def publish(self, message: Published) -> None:
        if self.machine is None:
            return
        self.machine.hook_publish(message)

    def lose_reply(self, script: str, run_id: str) -> bool:
        return self.machine is not None and self.machine.hook_lose_reply(script, run_id)

    def after_read(self, run_id: str) -> None:
        reaper = current_reaper()
        if reaper is not None:
            reaper.after_read(run_id)

    def records_down(self, run_id: str) -> bool:
        return self.machine is not None and self.machine.hook_records_down(run_id)

    def after_script(self, script: str, run_id: str, status: str) -> bool:
        return self.machine is not None and self.machine.hook_after_script(script, run_id, status)

    def strike(self, point: str) -> None:
        if self.machine is not None:
            self.machine.hook_strike(point)

    def __getattr__(self, name: str) -> Any:
        """A sibling check's own hooks (``hook_<name>``) go to its machine as they are."""
        if not name.startswith("hook_") or self.machine is None:
            raise AttributeError(name)
        return getattr(self.machine, name)


SWITCHBOARD = Switchboard()


@dataclass
class Resources:
    redis: Any
    directory: Path
    engine: Engine

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.close()
        self.redis.stop()


_RESOURCES: Resources | None = None
#: A Redis to use instead of starting one (its DB 0 is flushed before every example: a
#: private server only, one job at a time on it).
REDIS_URL_ENV = "SAGA_MODELCHECK_REDIS_URL"


class GivenRedis:
    """A redis-server someone else started and stops (``SAGA_MODELCHECK_REDIS_URL``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def stop(self) -> None:
        """Not ours to stop."""


def resources(engine_class: type[Engine] | None = None) -> Resources:
    """The process's private redis-server (never the shared one) and the engine on it
    (``engine_class``: ``Engine`` or a sibling check's subclass of it)."""
    global _RESOURCES
    engine_class = engine_class or Engine
    if _RESOURCES is not None and type(_RESOURCES.engine) is not engine_class:
        stop_resources()
    if _RESOURCES is None:
        directory = Path(tempfile.mkdtemp(prefix="saga-modelcheck-"))
        given = os.environ.get(REDIS_URL_ENV, "")
        server: Any = (
            GivenRedis(given)
            if given
            else RedisServer("--appendonly", "no", directory=directory / "redis").start()
        )
        try:
            engine = engine_class(
                server.url, f"sqlite:///{directory}/records.db", WORLD, SWITCHBOARD
            )
        except BaseException:
            import shutil

            server.stop()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        _RESOURCES = Resources(server, directory, engine)
        atexit.register(stop_resources)
    return _RESOURCES


def stop_resources() -> None:
    """Stop the private redis-server (by its PID) and remove its files."""
    global _RESOURCES
    if _RESOURCES is not None:
        import shutil

        _RESOURCES.stop()
        shutil.rmtree(_RESOURCES.directory, ignore_errors=True)
        _RESOURCES = None


@contextlib.contextmanager
def running(engine_class: type[Engine] | None = None) -> Iterator[Resources]:
    try:
        yield resources(engine_class)
    finally:
        stop_resources()


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The library logs every handled failure loudly; the model causes thousands of them.
    The levels are restored afterwards (the test suite's other tests read these logs)."""
    loggers = [logging.getLogger(n) for n in ("saga", "saga.worker", "saga.reaper", "celery")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


# =============================================================================================
# The state machine.
# =============================================================================================

RUN = st.integers(0, 1)
#: Faults after which a run may rightly wait for the reaper: a message lost for good, a
#: caller (not a worker, which retries) that saw a store error, or a delivery killed by the
#: hard time limit (Celery acks it and nothing in the task reports: its lease runs out and
#: the reaper settles the step).
LOSSES = (
    "revoke",
    "publish-refused",
    "conclude-given-up",
    "lost-reply-client",
    "time-limit-kill",
    "lost-message",
)
#: Faults that can rightly make a compensation fail (use up its attempts, record it failed):
#: after one of these on a run, a requeue of that run may end escalated again. A delivery the
#: hard time limit killed is a crash like any other: its attempt counts.
SPOILERS = (
    "crash",
    "revoke",
    "tool-fail",
    "duplicate",
    "ack-lost",
    "lost-reply",
    "time-limit-kill",
)
PICK = st.integers(0, 3)
TOOLS = st.sampled_from(list(CALLS))
#: The reaper's clock when nobody answered in time: past every question's deadline.
PAST_ASK_DEADLINE = REVERSAL_ASK_SECONDS + 60.0
#: More undos than this asking in one example's runs: beyond what the end of an example waits
#: out (each question is expired by a reaper pass of its own).
QUESTIONS_AT_MOST = 40


def step(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the example failed when a rule raises, so teardown only cleans up (a second
    exception from teardown would hide the first one from Hypothesis)."""

    @functools.wraps(function)
    def wrapper(self: ModelCheck, *args: Any, **kwargs: Any) -> Any:
        try:
            result = function(self, *args, **kwargs)
            self.world_holds()
            return result
        except BaseException:
            self.failed = True
            raise

    return wrapper


class ModelCheck(RuleBasedStateMachine):
    """The agent, the broker, the workers, the reaper, the operator and the faults."""

    #: The adapter this machine drives (a sibling check subclasses both).
    engine_class: type[Engine] = Engine

    def __init__(self) -> None:
        super().__init__()
        CAMPAIGN.example()
        self.engine = resources(self.engine_class).engine
        self.engine.reset()
        WORLD.reset()
        SWITCHBOARD.machine = self
        self.failed = False
        self.runs: list[str] = []
        self.ready: list[Message] = []
        self.unacked: list[Message] = []
        self.deliveries: list[Delivery] = []
        self.revoked_ids: set[str] = set()
        self.reaper: ReaperPass | None = None
        self.reaper_steps = 0
        self.message_seq = 0
        self.delivery_seq = 0
        self.call_seq = 0
        self.broker_lock = threading.RLock()
        # Faults.
        self.db_down = False
        #: "" | "any" | "worker": the next store script's reply (a worker's, for "worker") is lost
        self.reply_to_lose = ""
        self.refuse_publish = ""  # "" | "before" | "after": the next library publish fails
        self.dispatching: tuple[int, str] | None = None  # (agent call, send mode)
        self.internal_publish = False
        # What happened to each run (the faults that touched it), for reports and masks.
        self.touches: dict[str, list[str]] = {}
        #: Faults per run that can rightly make a compensation fail (``SPOILERS``): a
        #: requeue's expectation holds only if none came after it.
        self.events: dict[str, int] = {}
        #: Raised each time the model makes a compensation fail (``fail_compensations``).
        self.undo_fault_epoch = 0
        #: Runs requeued with their compensations healthy: (undo calls, events, fault epoch)
        #: at the requeue.
        self.requeue_expected: dict[str, tuple[int, int, int]] = {}
        # A person asked about a reversal.
        #: (run, step) -> (decision, hash shown) of each answer "reverse" or "keep" taken: a
        #: second answer must be refused.
        self.decided: dict[tuple[str, int], tuple[str, str]] = {}
        #: Every hash a person was shown (a stale one is another undo's).
        self.shown: list[str] = []
        #: "script" or "script:status": the next reply of that script (with that answer) is
        #: lost, whoever called it.
        self.lose_after = ""
        #: The library's fault point at which the next worker to reach it dies.
        self.armed_strike = ""
        #: The conclusion message being delivered (a worker dies in it at a fault point).
        self.concluding: Message | None = None
        WORLD.asked_probe = self.engine.asked_steps

    # -- helpers --------------------------------------------------------------------------

    def run_id(self, run: int) -> str:
        return self.runs[run % len(self.runs)]

    def in_state(self, state: str) -> list[str]:
        """The runs Redis says are in ``state`` (the agent only calls tools on a running
        run; an operator only requeues an escalated one)."""
        return [r for r in self.runs if self.engine.redis_state(r) == state]

    def touch(self, run_id: str, label: str) -> None:
        if label.startswith(SPOILERS):
            self.events[run_id] = self.events.get(run_id, 0) + 1
        labels = self.touches.setdefault(run_id, [])
        if label not in labels:
            labels.append(label)

    def touches_of(self, run_id: str) -> frozenset[str]:
        labels = set(self.touches.get(run_id, ()))
        if run_id in WORLD.failed_undo_runs:
            labels.add("undo-failed")
        return frozenset(labels)

    def say(self, text: str) -> None:
        if currently_in_test_context():
            note(f"    # {text}")
        elif NARRATION is not None:
            NARRATION.append(f"    # {text}")

    def violation(self, symptom: str, run_id: str, message: str) -> None:
        """Raise a violation, unless the campaign masks it (seen already, same faults)."""
        touches = self.touches_of(run_id)
        sighting = CAMPAIGN.see(symptom, touches, message)
        if CAMPAIGN.masked(symptom, touches):
            return
        CAMPAIGN.fail(sighting)
        self.failed = True
        label = run_id.split("-")[0] if run_id else "-"
        faults = ", ".join(sorted(touches)) or "none"
        raise violation_class(symptom)(
            f"[{symptom}] {label}: {message} (faults on the run: {faults})", touches
        )

    def unexpected(self, entry: str, run_id: str, exc: BaseException) -> None:
        """An entry point raised something the library does not document."""
        if isinstance(exc, Violation):
            raise exc  # found by a hook while the entry point ran
        if is_documented(exc):
            return
        self.violation(
            f"exception:{entry}:{qualified(exc)}",
            run_id,
            f"{entry} raised {qualified(exc)}: {first_line(exc)}",
        )

    def blocked(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.phase == "blocked"]

    # -- the engine's hooks -------------------------------------------------------------------

    def hook_publish(self, published: Published) -> None:
        info = self.engine.describe(published.name, published.kwargs)
        mode = ""
        if not self.internal_publish:
            if self.dispatching is not None and info.kind == "step":
                call, send = self.dispatching
                WORLD.call_of_step[(info.run_id, info.step or 0)] = call
                mode = "" if send == "ok" else send
            if not mode and self.refuse_publish:
                mode, self.refuse_publish = self.refuse_publish, ""
                self.touch(info.run_id, f"publish-refused-{mode}")
        if mode == "before":
            raise BrokerError("Connection refused (model: publish refused)")
        message = self.enqueue(published, info)
        if mode == "after":
            raise BrokerError("Connection reset by peer (model: the publish went through)")
        if mode == "after_started":
            with self.broker_lock:
                self.ready.remove(message)
            self.start(message)
            raise BrokerError("Connection reset by peer (model: published and already started)")

    def enqueue(self, published: Published, info: MessageInfo, retries: int = 0) -> Message:
        with self.broker_lock:
            self.message_seq += 1
            message = Message(self.message_seq, published, info, retries)
            self.ready.append(message)
            return message

    def requeue_copy(self, message: Message) -> None:
        """Celery's ``Task.retry``: the same message again, one retry more."""
        self.enqueue(message.published, message.info, message.retries + 1)

    def hook_lose_reply(self, script: str, run_id: str) -> bool:
        # Outside a worker, the caller (agent, operator, reaper) sees the error: what it leaves
        # behind may rightly wait for the reaper. A worker retries by itself.
        side = "worker" if current_delivery() is not None else "client"
        if not self.reply_to_lose or (self.reply_to_lose == "worker" and side != "worker"):
            return False
        self.reply_to_lose = ""
        self.touch(run_id, f"lost-reply-{side}:{script}")
        return True

    def hook_records_down(self, run_id: str) -> bool:
        if self.db_down:
            self.touch(run_id, "db-refused")
        return self.db_down

    def hook_after_script(self, script: str, run_id: str, status: str) -> bool:
        """A reply lost once the script answered (``lose_after``); a worker whose undo asks a
        person blocks right after the ask is written, before anything else (the model may kill
        it there: the message comes back)."""
        if self.lose_after in (script, f"{script}:{status}"):
            self.lose_after = ""
            side = "worker" if current_delivery() is not None else "client"
            self.touch(run_id, f"lost-reply-{side}:{script}")
            return True
        delivery = current_delivery()
        if delivery is not None and script == "begin_compensation" and status in ("ask", "asked"):
            command = delivery.gate(f"after the ask ({status})")
            if command in (Command.CRASH_BEFORE, Command.CRASH_AFTER):
                raise WorkerCrash(f"killed right after begin_compensation answered {status}")
        return False

    def hook_strike(self, point: str) -> None:
        """A worker (a delivery, or the conclusion's) reaching the armed fault point dies."""
        if not self.armed_strike or point != self.armed_strike:
            return
        delivery = current_delivery()
        message = delivery.message if delivery is not None else self.concluding
        if message is None:
            return  # not a worker (an operator's call, the reaper): not this fault
        self.armed_strike = ""
        self.touch(message.info.run_id, f"crash-{point.replace('_', '-')}")
        raise WorkerCrash(f"killed at {point}")

    # -- deliveries ---------------------------------------------------------------------------

    def start(self, message: Message) -> Delivery | None:
        """Hand ``message`` to a worker: a tool runs until it blocks in the tool (or the
        worker finishes without running it); a conclusion runs at once."""
        info = message.info
        if message.task_id in self.revoked_ids:
            # The worker discards a revoked id on receipt and announces the revoke.
            self.say(f"{message.label()} discarded: revoked")
            self.engine.revoked(message.published, False)
            return None
        if info.kind == "conclude":
            self.conclude(message)
            return None
        if info.kind not in ("step", "undo"):
            return None
        task = FakeTask(self.engine.app, message, self.requeue_copy)
        return self.run_delivery(message, task, "delivery", "blocked in the tool")

    def run_delivery(
        self, message: Message, task: Any, thread: str, blocked: str
    ) -> Delivery | None:
        """Run ``message``'s delivery in a thread of its own until it blocks (``blocked``
        says where) or finishes; the delivery, or None once it is done."""
        self.delivery_seq += 1
        delivery = Delivery(self.delivery_seq, message, task)
        worker = threading.Thread(
            target=self._work, args=(delivery,), name=f"{thread}-{delivery.number}", daemon=True
        )
        delivery.thread = worker
        worker.start()
        if not delivery.wait():
            label = message.label()
            self.violation("hang", message.info.run_id, f"{label} never blocked nor finished")
        if delivery.phase == "done":
            self.finish(delivery)
            return None
        self.deliveries.append(delivery)
        if delivery.where != "in the tool":
            blocked = f"blocked {delivery.where}"
        self.say(f"{message.label()} delivered: {blocked} (d{delivery.number})")
        return delivery

    def _work(self, delivery: Delivery) -> None:
        _LOCAL.delivery = delivery
        published = delivery.message.published
        try:
            self.engine.deliver(published.name, published.kwargs, delivery.task)
            delivery.outcome = "returned"
        except Ignore:
            delivery.outcome = "ignored"
        except Retry:
            delivery.outcome = "retry"
        except WorkerCrash:
            delivery.outcome = "crash"
        except BaseException as exc:
            delivery.outcome = "failed"
            delivery.exc = exc
        finally:
            with delivery.cond:
                delivery.phase = "done"
                delivery.cond.notify_all()

    def finish(self, delivery: Delivery, ack_lost: bool = False) -> None:
        """What Celery does once the task function is over: send the rest of the chain after
        a success, ack, or leave the message unacked after a crash."""
        with contextlib.suppress(ValueError):
            self.deliveries.remove(delivery)
        message = delivery.message
        run_id = message.info.run_id
        outcome = delivery.outcome
        detail = f": {type(delivery.exc).__name__}" if delivery.exc is not None else ""
        self.say(f"{message.label()} d{delivery.number} {outcome}{detail}")
        if outcome == "crash":
            if delivery.terminated:  # revoked with terminate: acked, never redelivered
                alive = {d.message.task_id for d in self.deliveries}
                self.engine.dead_lease_ran_out(message.info, message.task_id, alive)
                return
            self.unacked.append(message)
            return
        if outcome == "returned":
            chain = delivery.task.request.chain
            if chain:
                self.continue_chain(chain, message)
        elif outcome == "failed":
            exc = delivery.exc
            assert exc is not None
            if not isinstance(exc, ToolDown) and not is_documented(exc):
                self.violation(
                    f"exception:worker:{qualified(exc)}",
                    run_id,
                    f"{message.label()} raised {qualified(exc)}: {first_line(exc)}",
                )
        if ack_lost and not delivery.terminated:
            self.touch(run_id, "ack-lost")
            self.unacked.append(message)

    def continue_chain(self, chain: list[dict[str, Any]], message: Message) -> None:
        """Celery's tracer after a success: publish the next task with the rest of the chain."""
        self.internal_publish = True
        try:
            following = signature(chain[-1], app=self.engine.app)
            following.apply_async(
                (None,), chain=chain[:-1], parent_id=message.task_id, root_id=message.root_id
            )
        finally:
            self.internal_publish = False

    def conclude(self, message: Message) -> None:
        """``saga.conclude_unwind``: any error retries it, up to Celery's max_retries."""
        run_id = message.info.run_id
        self.concluding = message
        try:
            self.engine.conclude(message.published.kwargs)
            self.say(f"{message.label()} concluded: {self.engine.redis_state(run_id)}")
        except WorkerCrash:
            self.say(f"{message.label()} killed: the message comes back")
            self.unacked.append(message)
        except Exception as exc:
            if not is_documented(exc) and not is_records_outage(exc):
                self.unexpected("conclude", run_id, exc)
            if message.retries < CONCLUDE_MAX_RETRIES:
                self.say(f"{message.label()} retried: {type(exc).__name__}")
                self.requeue_copy(message)
            else:
                self.say(f"{message.label()} given up: {type(exc).__name__}")
                self.touch(run_id, "conclude-given-up")
        finally:
            self.concluding = None

    def deliver_fully(self, message: Message) -> None:
        delivery = self.start(message)
        if delivery is not None:
            self.order(delivery, Command.PROCEED)

    def order(self, delivery: Delivery, command: Command, ack_lost: bool = False) -> None:
        if not delivery.order(command):
            self.violation(
                "hang",
                delivery.message.info.run_id,
                f"{delivery.message.label()} did not finish after {command.value}",
            )
        self.finish(delivery, ack_lost)

    def pop(self, queue: list[Message], pick: int) -> Message:
        with self.broker_lock:
            return queue.pop(pick % len(queue))

    # -- rules: the agent ----------------------------------------------------------------------

    @initialize(count=st.integers(1, 2), undo_failures=st.integers(0, 3))
    @step
    def start_runs(self, count: int, undo_failures: int) -> None:
        """``count`` runs; the systems behind the compensations fail the first
        ``undo_failures`` undo calls (so unwinds escalate, and requeues have work to do)."""
        WORLD.undo_failures = undo_failures
        self.runs = [self.engine.new_run(f"run{i}") for i in range(count)]
        for run_id in self.runs:
            self.touches[run_id] = []

    @precondition(lambda self: bool(self.in_state("running")))
    @rule(run=RUN, tool=TOOLS)
    @step
    def dispatch(self, run: int, tool: str) -> None:
        """The agent calls a tool (on one of the running runs)."""
        self.call(run, tool, "ok")

    @precondition(lambda self: bool(self.in_state("running")))
    @rule(run=RUN, tool=TOOLS, send=st.sampled_from(["before", "after", "after_started"]))
    @step
    def dispatch_publish_fails(self, run: int, tool: str, send: str) -> None:
        """The agent calls a tool and the publish fails: ``before`` it reached the broker,
        ``after`` (queued, the caller sees the error), or ``after_started`` (a worker already
        began the step when the error came back)."""
        running = self.in_state("running")
        self.touch(running[run % len(running)], f"dispatch-refused-{send}")
        self.call(run, tool, send)

    def call(self, run: int, tool: str, send: str) -> None:
        """One agent call; an error the library marks retryable is retried once, as an agent
        would (each attempt may reserve a new step)."""
        running = self.in_state("running")
        run_id = running[run % len(running)]
        self.call_seq += 1
        call = self.call_seq
        self.dispatching = (call, send)
        try:
            try:
                self.engine.dispatch(run_id, tool)
                return
            except Exception as exc:
                self.say(f"dispatch {tool}: {type(exc).__name__}: {first_line(exc)}")
                if not agent_retries(exc):
                    self.unexpected("dispatch", run_id, exc)
                    return
            self.dispatching = (call, "ok")
            try:
                self.engine.dispatch(run_id, tool)
            except Exception as exc:
                self.say(f"dispatch {tool} again: {type(exc).__name__}")
                self.unexpected("dispatch", run_id, exc)
        finally:
            self.dispatching = None

    @precondition(lambda self: self.call_seq > 0 and bool(self.in_state("running")))
    @rule(run=RUN, how=st.sampled_from(["abort", "complete"]))
    @step
    def end_run(self, run: int, how: str) -> None:
        """The agent aborts the run (unwind, or escalate past the pivot) or completes it.
        One rule for both, and only once the agent called something, so runs do not end
        too early in most examples."""
        running = self.in_state("running")
        run_id = running[run % len(running)]
        try:
            if how == "abort":
                self.engine.abort(run_id)
            else:
                self.engine.complete(run_id)
                self.say(f"completed {run_id.split('-')[0]}")
        except Exception as exc:
            self.say(f"{how}: {type(exc).__name__}")
            self.unexpected(how, run_id, exc)

    # -- rules: the broker and the workers -----------------------------------------------------

    @precondition(lambda self: bool(self.ready))
    @rule(pick=PICK)
    @step
    def start_delivery(self, pick: int) -> None:
        self.start(self.pop(self.ready, pick))

    @precondition(lambda self: bool(self.ready))
    @rule()
    @step
    def settle(self) -> None:
        """Deliver every queued message in order, each to its end (tools proceed)."""
        for _ in range(60):
            if not self.ready:
                return
            self.deliver_fully(self.pop(self.ready, 0))

    @precondition(lambda self: bool(self.blocked()))
    @rule(
        pick=PICK,
        outcome=st.sampled_from(["proceed", "fail", "fail_final"]),
        ack_lost=st.booleans(),
    )
    @step
    def finish_delivery(self, pick: int, outcome: str, ack_lost: bool) -> None:
        """The blocked tool applies its effect (or fails before it: ``fail`` retryably,
        ``fail_final`` for good); ``ack_lost``: the worker dies after the task function
        returned, before the ack (the message comes back)."""
        blocked = self.blocked()
        delivery = blocked[pick % len(blocked)]
        if outcome != "proceed":
            self.touch(delivery.message.info.run_id, f"tool-{outcome}")
        self.order(delivery, Command(outcome), ack_lost)

    @precondition(lambda self: bool(self.blocked()))
    @rule(pick=PICK, after_effect=st.booleans())
    @step
    def crash_delivery(self, pick: int, after_effect: bool) -> None:
        """kill -9 of the worker in the tool: nothing recorded, the message is unacked."""
        blocked = self.blocked()
        delivery = blocked[pick % len(blocked)]
        self.touch(delivery.message.info.run_id, "crash-after-effect" if after_effect else "crash")
        self.order(delivery, Command.CRASH_AFTER if after_effect else Command.CRASH_BEFORE)

    @precondition(lambda self: bool(self.ready or self.unacked))
    @rule(action=st.sampled_from(["redeliver", "duplicate", "revoke", "lose"]), pick=PICK)
    @step
    def broker(self, action: str, pick: int) -> None:
        """The broker acts on a queued message: ``redeliver`` an unacked one (visibility
        timeout, a standby worker's restore); ``duplicate`` one (a publish retried after a
        lost confirm); ``revoke`` one not running (the worker discards it, and every later
        copy of its id, and announces the revoke with terminated=False); ``lose`` one (a
        broker without persistence restarted: nobody is told, only the store remembers)."""
        if action == "redeliver":
            if self.unacked:
                message = self.pop(self.unacked, pick)
                alive = frozenset(d.message.task_id for d in self.deliveries)
                self.engine.lease_ran_out(message.info, alive)
                with self.broker_lock:
                    self.ready.append(message)
            return
        if action == "duplicate":
            if self.ready:
                with self.broker_lock:
                    message = self.ready[pick % len(self.ready)]
                self.touch(message.info.run_id, "duplicate")
                self.enqueue(message.published, message.info, message.retries)
            return
        queued = self.ready + self.unacked
        message = queued[pick % len(queued)]
        with self.broker_lock:
            for queue in (self.ready, self.unacked):
                if message in queue:
                    queue.remove(message)
        if action == "lose":
            self.touch(message.info.run_id, "lost-message")
            self.say(f"{message.label()} lost by the broker")
            alive = {d.message.task_id for d in self.deliveries}
            self.engine.dead_lease_ran_out(message.info, message.task_id, alive)
            return
        self.revoked_ids.add(message.task_id)
        self.touch(message.info.run_id, "revoke")
        self.say(f"{message.label()} revoked")
        self.engine.revoked(message.published, False)
        # A delivery of this message that died (its copy sat unacked) never comes back now:
        # its lease runs out on the Redis clock while nobody redelivers it.
        alive = {d.message.task_id for d in self.deliveries}
        self.engine.dead_lease_ran_out(message.info, message.task_id, alive)

    @precondition(lambda self: bool(self.blocked()))
    @rule(pick=PICK)
    @step
    def revoke_terminate(self, pick: int) -> None:
        """``revoke(task_id, terminate=True)`` of a running task: the revoke is announced at
        once; the dying child may still finish, apply its effect or be killed (later rules)."""
        blocked = self.blocked()
        delivery = blocked[pick % len(blocked)]
        message = delivery.message
        delivery.terminated = True
        self.revoked_ids.add(message.task_id)
        self.touch(message.info.run_id, "revoke-terminate")
        self.say(f"{message.label()} d{delivery.number} revoked (terminate)")
        self.engine.revoked(message.published, True)

    # -- rules: the reaper ---------------------------------------------------------------------

    @precondition(lambda self: self.reaper is None)
    @rule(clock=st.sampled_from(list(CLOCKS)))
    @step
    def reap(self, clock: str) -> None:
        """A reaper pass with its clock ``clock`` ahead of now."""
        self.time_limit_passes(CLOCKS[clock])
        self.reap_at(CLOCKS[clock], touch=True)

    def time_limit_passes(self, offset: float) -> None:
        """A clock past the task time limit means Celery's hard time limit has killed every
        delivery still running by then (a timeout is a failure: the message is acked, never
        redelivered); a reaper must never look at a step whose tool is still running then."""
        if offset < TASK_TIME_LIMIT:
            return
        for delivery in self.blocked():
            delivery.terminated = True
            self.touch(delivery.message.info.run_id, "time-limit-kill")
            self.order(delivery, Command.CRASH_BEFORE)

    def reap_at(self, offset: float, touch: bool) -> dict[str, list[str]] | None:
        """One reaper pass ``offset`` seconds ahead: what it did to each run (None if it
        raised, which is reported)."""
        try:
            done = self.engine.reap(time.time() + offset)
        except Exception as exc:
            self.unexpected("reap", "", exc)
            return None
        for run_id, labels in done.items():
            self.say(f"reaper: {run_id.split('-')[0]} {', '.join(labels)}")
            if touch:
                for label in labels:
                    self.touch(run_id, label)
        return done

    @precondition(lambda self: self.reaper is None)
    @rule(run=RUN, clock=st.sampled_from(list(CLOCKS)))
    @step
    def reap_paused(self, run: int, clock: str) -> None:
        """A reaper pass that pauses right after it read the run (it acts on that read once
        ``resume_reaper`` lets it go on)."""
        self.time_limit_passes(CLOCKS[clock])
        self.pause_reaper(self.run_id(run), CLOCKS[clock])

    def pause_reaper(self, run_id: str, offset: float) -> None:
        """Start a reaper pass ``offset`` seconds ahead that pauses after reading ``run_id``."""
        reaper = ReaperPass(run_id, time.time() + offset)
        reaper.offset = offset

        def work() -> None:
            _LOCAL.reaper = reaper
            try:
                reaper.done = self.engine.reap(reaper.now)
            except BaseException as exc:
                reaper.exc = exc
            finally:
                with reaper.cond:
                    reaper.phase = "done"
                    reaper.cond.notify_all()

        threading.Thread(target=work, name="reaper", daemon=True).start()
        if not reaper.wait():
            self.violation("hang", reaper.run_id, "the reaper pass never paused nor finished")
        if reaper.phase == "done":
            self.reaper_done(reaper)
            return
        self.reaper = reaper
        self.reaper_steps = 0
        self.say(f"reaper paused after reading {reaper.run_id.split('-')[0]}")

    @precondition(lambda self: self.reaper is None and bool(self.ready))
    @rule(pick=PICK, clock=st.sampled_from(["past_deadline", "far_future"]))
    @step
    def reaper_races_delivery(self, pick: int, clock: str) -> None:
        """A reaper pass reads a run, and before it acts on what it read a worker begins a
        queued message of that run (it blocks in the tool, or right after its undo asked a
        person); ``resume_reaper`` lets the pass go on."""
        with self.broker_lock:
            message = self.ready.pop(pick % len(self.ready))
        self.time_limit_passes(CLOCKS[clock])
        self.pause_reaper(message.info.run_id, CLOCKS[clock])
        self.start(message)

    @precondition(lambda self: self.reaper is not None)
    @rule()
    @step
    def resume_reaper(self) -> None:
        reaper = self.reaper
        assert reaper is not None
        self.reaper = None
        # Deliveries begun while it was paused began, on its clock, at its "now": past the
        # time limit, they are dead by the time it acts.
        self.time_limit_passes(reaper.offset)
        if not reaper.resume():
            self.violation("hang", reaper.run_id, "the resumed reaper pass never finished")
        if self.reaper_steps > 0 and reaper.done.get(reaper.run_id):
            self.touch(reaper.run_id, "reaper-stale-read")
        self.reaper_done(reaper)

    def reaper_done(self, reaper: ReaperPass) -> None:
        if reaper.exc is not None:
            self.unexpected("reap", reaper.run_id, reaper.exc)
        for run_id, labels in reaper.done.items():
            self.say(f"reaper: {run_id.split('-')[0]} {', '.join(labels)}")
            for label in labels:
                self.touch(run_id, label)

    # -- rules: the operator -------------------------------------------------------------------

    @precondition(lambda self: bool(self.in_state("escalated")))
    @rule(run=RUN, fix=st.booleans())
    @step
    def requeue(self, run: int, fix: bool) -> None:
        """``requeue_failed_compensations``, with the cause fixed first or not. With fewer
        failures left than a compensation's attempts (and no step in doubt that nothing can
        tell), the requeued unwind must compensate."""
        escalated = self.in_state("escalated")
        run_id = escalated[run % len(escalated)]
        if fix:
            WORLD.undo_failures = 0
        # An undo whose tool asks a person (and no person said reverse) asks again: the run
        # then waits for an answer, not for the requeued undos alone.
        asks = any(
            u.would_ask and u.state in ("failed", "pending")
            for u in self.engine.undos(run_id).values()
        )
        healthy = (
            WORLD.undo_failures < ATTEMPTS and not self.engine.doubt_unresolved(run_id) and not asks
        )
        self.touch(run_id, "requeue")
        self.requeue_expected.pop(run_id, None)
        mark = (WORLD.undo_calls.get(run_id, 0), self.events.get(run_id, 0), self.undo_fault_epoch)
        try:
            count = self.engine.requeue(run_id)
        except Exception as exc:
            self.say(f"requeue: {type(exc).__name__}")
            self.unexpected("requeue", run_id, exc)
            return
        if healthy:
            self.requeue_expected[run_id] = mark
        self.say(f"requeued {count} compensation(s); expected to compensate: {healthy}")

    # -- rules: a person asked about a reversal --------------------------------------------------

    def questions(self) -> list[tuple[str, int, str]]:
        """(run, step, hash) of each undo waiting for a person's answer in an unwinding run."""
        found = []
        for run_id in self.runs:
            if self.engine.redis_state(run_id) != "unwinding":
                continue
            for step_, undo in sorted(self.engine.undos(run_id).items()):
                if undo.state == "asked":
                    found.append((run_id, step_, undo.ask_hash))
        return found

    def decide(self, run_id: str, step_: int, decision: str, shown: str) -> str:
        """A person's answer: ``taken``, ``refused`` or ``lost`` (the store's reply was lost:
        the person saw an error)."""
        note = "model: kept on purpose" if decision == "keep" else ""
        try:
            self.engine.decide(run_id, step_, decision, shown, note)
            return "taken"
        except Exception as exc:
            self.say(f"decide {decision}: {type(exc).__name__}: {first_line(exc)}")
            if answer_refused(exc):
                return "refused"
            if isinstance(exc, StoreUnavailableError):
                return "lost"
            self.unexpected("decide_reversal", run_id, exc)
            return "refused"

    @precondition(lambda self: bool(self.questions()))
    @rule(
        pick=PICK,
        decision=st.sampled_from(["reverse", "keep", "later"]),
        shown=st.sampled_from(["right", "right", "stale", "none"]),
        reply=st.sampled_from(["ok", "ok", "lost"]),
    )
    @step
    def answer(self, pick: int, decision: str, shown: str, reply: str) -> None:
        """A person answers a waiting question: ``reverse`` now, ``keep`` the effect (with a
        note) or decide ``later``, with the hash of the undo they were shown (``right``),
        another undo's (``stale``) or none: those must be refused, changing nothing. ``lost``:
        the store's reply is lost (the answer may have been taken); the person tries again."""
        questions = self.questions()
        run_id, step_, right = questions[pick % len(questions)]
        stale = next((h for h in self.shown if h != right), "0" * 40)
        given = {"right": right, "stale": stale, "none": ""}[shown]
        self.shown.append(right)
        self.events[run_id] = self.events.get(run_id, 0) + 1
        self.touch(run_id, f"answer-{decision}" + ("" if shown == "right" else f"-{shown}"))
        before = self.engine.snapshot(run_id)
        expires = self.engine.undos(run_id)[step_].ask_expires or 0.0
        armed = self.lose_after
        if reply == "lost":
            self.lose_after = "decide_reversal"
        said = self.decide(run_id, step_, decision, given)
        if reply == "lost":
            self.lose_after = armed  # a fault armed before stays armed
        self.say(f"{decision} step {step_} ({shown} hash): {said}")
        if shown != "right":
            if said == "taken":
                self.violation(
                    "wrong-hash-taken", run_id, f"{decision} with a {shown} hash was taken"
                )
            if self.engine.snapshot(run_id) != before:
                self.violation(
                    "refused-answer-changed-run",
                    run_id,
                    f"{decision} with a {shown} hash was refused, yet the run's keys changed",
                )
            return
        if said == "refused":
            self.violation(
                "answer-refused", run_id, f"{decision} of a waiting question (right hash) refused"
            )
        if said == "lost":  # the person sees an error and answers again
            again = self.engine.snapshot(run_id)
            retried = self.decide(run_id, step_, decision, right)
            self.say(f"{decision} step {step_} again: {retried}")
            if decision != "later" and retried == "taken":
                self.violation(
                    "second-answer-taken", run_id, f"{decision} repeated after a lost reply"
                )
            # (A lost repeat may have been taken: only one the store refused changes nothing.)
            if retried == "refused" and self.engine.snapshot(run_id) != again:
                self.violation(
                    "refused-answer-changed-run", run_id, f"a refused repeat of {decision}"
                )
        undo = self.engine.undos(run_id)[step_]
        if decision == "later":
            if undo.state != "asked" or (undo.ask_expires or 0.0) < expires:
                self.violation(
                    "later-not-asked-again",
                    run_id,
                    f"after later, step {step_}'s undo is {undo.state} (until "
                    f"{undo.ask_expires}, was {expires})",
                )
            return
        wanted = "kept" if decision == "keep" else "pending"
        if undo.state != wanted:
            self.violation(
                f"{decision}-not-taken", run_id, f"after {decision}, step {step_} is {undo.state}"
            )
        self.decided[(run_id, step_)] = (decision, right)

    def answered(self) -> list[tuple[str, int, str, str]]:
        """(run, step, decision, hash) of each answer reverse or keep taken, in run order."""
        return [
            (run_id, step_, decision, shown)
            for run_id in self.runs
            for (of, step_), (decision, shown) in sorted(self.decided.items())
            if of == run_id
        ]

    @precondition(lambda self: bool(self.decided))
    @rule(pick=PICK, decision=st.sampled_from(["reverse", "keep", "later"]))
    @step
    def answer_again(self, pick: int, decision: str) -> None:
        """A person answers a question already answered (reverse or keep), with the hash they
        were shown: an answer is used once, so it must be refused, changing nothing."""
        answered = self.answered()
        run_id, step_, first, shown = answered[pick % len(answered)]
        before = self.engine.snapshot(run_id)
        said = self.decide(run_id, step_, decision, shown)
        self.say(f"{decision} step {step_} again (it was {first}): {said}")
        if said == "taken":
            self.violation(
                "second-answer-taken", run_id, f"{decision} taken after {first} was answered"
            )
        if self.engine.snapshot(run_id) != before:
            self.violation(
                "refused-answer-changed-run", run_id, f"a refused {decision} after {first}"
            )

    @precondition(lambda self: self.reaper is None and bool(self.questions()))
    @rule(pick=PICK, paused=st.booleans())
    @step
    def questions_expire(self, pick: int, paused: bool) -> None:
        """Nobody answers: the clock passes every question's deadline (and every task time
        limit), and a reaper pass comes (``paused``: it pauses after reading a run with a
        question, so a person may still answer, or a worker act, before it goes on)."""
        questions = self.questions()
        run_id = questions[pick % len(questions)][0]
        for asked in {q[0] for q in questions}:
            self.events[asked] = self.events.get(asked, 0) + 1
            self.touch(asked, "ask-expired")
        self.time_limit_passes(PAST_ASK_DEADLINE)
        if paused:
            self.pause_reaper(run_id, PAST_ASK_DEADLINE)
        else:
            self.reap_at(PAST_ASK_DEADLINE, touch=True)

    # -- rules: faults -------------------------------------------------------------------------

    @rule(
        kind=st.sampled_from(
            [
                "undo_fails_1",
                "undo_fails_2",
                "undo_fails_3",
                "lose_next_reply",
                "lose_next_worker_reply",
                "refuse_next_publish",
                "publish_then_fail",
                "db_down",
                "db_up",
                "lose_ask_reply",
                "lose_decide_reply",
                "crash_after_conclusion",
            ]
        )
    )
    @step
    def fault(self, kind: str) -> None:
        """``undo_fails_N``: the systems behind the compensations fail the next N undo calls
        (retryably). ``lose_next_reply``: the next store script runs on the server, its reply
        is lost on the way back; ``lose_next_worker_reply``: the same, for the next script a
        worker runs (a step's or an undo's outcome: the replies whose loss a retry must
        survive, however many client calls come first). ``refuse_next_publish``: the broker
        refuses the library's next publish; ``publish_then_fail``: it takes the message, the
        caller sees an error.
        ``db_down`` / ``db_up``: the records database goes away / comes back.
        ``lose_ask_reply``: the reply of the next ``begin_compensation`` that asks a person is
        lost (the worker retries it); ``lose_decide_reply``: the reply of the next answer taken
        (a person's, or the reaper's expiry) is lost; ``crash_after_conclusion``: the next
        worker to write a run's conclusion dies right after it (``after_conclusion``)."""
        if kind == "lose_ask_reply":
            self.lose_after = "begin_compensation:ask"
        elif kind == "lose_decide_reply":
            self.lose_after = "decide_reversal:ok"
        elif kind == "crash_after_conclusion":
            self.armed_strike = "after_conclusion"
        elif kind.startswith("undo_fails_"):
            WORLD.undo_failures = int(kind.rsplit("_", 1)[1])
            self.undo_fault_epoch += 1
        elif kind in ("lose_next_reply", "lose_next_worker_reply"):
            self.reply_to_lose = "any" if kind == "lose_next_reply" else "worker"
        elif kind in ("refuse_next_publish", "publish_then_fail"):
            self.refuse_publish = "before" if kind == "refuse_next_publish" else "after"
        else:
            self.db_down = kind == "db_down"

    # -- invariants ----------------------------------------------------------------------------

    def world_holds(self) -> None:
        """What the world saw at once: two effects for one call, an undo of nothing or twice,
        undos out of order, two executions at once."""
        if self.reaper is not None:
            self.reaper_steps += 1
        with WORLD.lock:
            findings = list(WORLD.findings)
        for finding in findings:
            try:
                self.violation(finding.symptom, finding.run_id, finding.message)
            except Violation:
                self.failed = True
                raise

    def teardown(self) -> None:
        try:
            if not self.failed:
                self.quiesce_and_check()
        finally:
            self.abandon()
            SWITCHBOARD.machine = None

    def abandon(self) -> None:
        """Stop every thread of the example (a failed example leaves tools blocked)."""
        self.db_down = False
        if self.reaper is not None:
            self.reaper.resume()
            self.reaper = None
        for delivery in list(self.deliveries):
            delivery.order(Command.CRASH_BEFORE)
        self.deliveries.clear()

    # -- the end of an example ------------------------------------------------------------------

    def drain(self, budget: int = 400) -> None:
        """Deliver everything: finish blocked tools, bring unacked messages back, deliver the
        queue in order, until nothing is left."""
        for _ in range(budget):
            if self.deliveries:
                delivery = self.deliveries[0]
                self.order(delivery, Command.PROCEED)
            elif self.unacked:
                with self.broker_lock:
                    for message in self.unacked:
                        self.engine.lease_ran_out(message.info)
                    self.ready.extend(self.unacked)
                    self.unacked.clear()
            elif self.ready:
                self.deliver_fully(self.pop(self.ready, 0))
            else:
                return
            self.world_holds()
        self.violation("endless-messages", "", f"still delivering after {budget} deliveries")

    def quiesce_and_check(self) -> None:
        """The actors stop (database up, no more faults), everything queued is delivered,
        the reaper runs with the clock moving forward; then every run must have ended as the
        world says it should."""
        self.db_down = False
        self.reply_to_lose = ""
        self.refuse_publish = ""
        self.lose_after = ""
        self.armed_strike = ""
        WORLD.undo_failures = 0
        if self.reaper is not None:
            reaper, self.reaper = self.reaper, None
            if not reaper.resume():
                self.violation("hang", reaper.run_id, "the resumed reaper pass never finished")
            self.reaper_done(reaper)
        self.drain()
        for run_id in self.runs:
            # Unless a message of the run was lost for good (revoked, refused, given up) or a
            # caller saw a store error, its unwind must end without the reaper's help.
            lost = any(label.startswith(LOSSES) for label in self.touches_of(run_id))
            # Waiting for a person's answer is no stall: the reaper expires the question.
            waits = any(u.state == "asked" for u in self.engine.undos(run_id).values())
            if not lost and not waits and self.engine.redis_state(run_id) == "unwinding":
                self.violation(
                    "stalled-without-reaper",
                    run_id,
                    "unwinding with nothing queued or running: only the reaper (at the "
                    "run's deadline) can end it",
                )
        # The last clocks lie past anything an earlier pass (at "far_future") may have
        # rescheduled a run to: a real clock only moves forward.
        farther = (3 * CLOCKS["far_future"], 9 * CLOCKS["far_future"])
        for offset in (CLOCKS["past_deadline"], CLOCKS["past_time_limit"], *farther):
            passes = 0
            # A pass that expired a question is progress, not a try: the unwind goes on to the
            # next undo, which may ask again (each is expired by a pass of its own).
            for _ in range(3 + 3 * QUESTIONS_AT_MOST):
                if passes >= 3:
                    break
                passes += 1
                # Ended and recorded (an ended run whose record waits for the database is the
                # reaper's to write once the database is back). Recorded as the keys say: SQL
                # may hold an earlier record of the same state (a reaper's stale pass wrote the
                # run's first escalation after a requeue moved it on to its second).
                states = [
                    (
                        self.engine.redis_state(r),
                        self.engine.sql_state(r),
                        self.engine.redis_recorded(r),
                    )
                    for r in self.runs
                ]
                if all(
                    s in ("completed", "compensated", "escalated") and s == q and recorded
                    for s, q, recorded in states
                ):
                    break
                done = self.reap_at(offset, touch=False) or {}
                if any("reaper-unanswered" in labels for labels in done.values()):
                    passes -= 1
                self.drain()
        for run_id in self.runs:
            self.check_run(run_id)

    def check_run(self, run_id: str) -> None:
        state = self.engine.redis_state(run_id)
        if state not in ("completed", "compensated", "escalated"):
            self.violation(f"stuck-{state}", run_id, f"still {state} after the reaper's passes")
            return
        sql = self.engine.sql_state(run_id)
        if sql != state:
            self.violation("sql-disagrees", run_id, f"Redis says {state}, SQL says {sql}")
        if not self.engine.redis_recorded(run_id):
            self.violation("unrecorded", run_id, f"{state}, its end never recorded in SQL")
        escalations = self.engine.open_escalations(run_id)
        kept = state == "escalated" and kept_on_purpose(self.engine.redis_reason(run_id))
        if kept:
            # Every undo not done was kept by a person: escalated, and resolved by that
            # decision (the effect on the books), not left open for someone to find.
            rows = self.engine.escalations(run_id)
            if escalations or not rows or not rows[-1].resolved:
                self.violation(
                    "kept-not-resolved",
                    run_id,
                    "ended kept on purpose, yet its escalation is "
                    + ("open" if escalations else "missing" if not rows else "not resolved"),
                )
            escalations = rows[-1:]
        elif state == "escalated" and not escalations:
            self.violation("escalated-without-open-escalation", run_id, "no open escalation row")
        if state != "escalated" and escalations:
            self.violation("open-escalation-after-end", run_id, f"{state}, an escalation is open")
        self.check_reversals(run_id, state, escalations)
        listed = frozenset().union(*(e.live_steps for e in escalations))
        for effect in WORLD.effects_of(run_id):
            where = f"step {effect.step} ({effect.tool}, class {effect.klass})"
            if effect.undone_by is not None:
                if state == "completed":
                    self.violation("undone-in-completed-run", run_id, f"{where} was undone")
                continue
            if state == "compensated" and effect.klass == 5:
                self.violation("irreversible-in-compensated-run", run_id, f"{where} happened")
            elif state == "compensated" and effect.klass in (3, 4):
                self.violation("live-in-compensated-run", run_id, f"{where} is live, not undone")
            elif state == "escalated" and effect.step not in listed:
                self.violation(
                    "live-not-escalated", run_id, f"{where} is live, no open escalation lists it"
                )
        expected = self.requeue_expected.get(run_id)
        now = (self.events.get(run_id, 0), self.undo_fault_epoch)
        if expected is not None and now != expected[1:]:
            expected = None  # something else happened to the run since: no expectation
        if expected is not None and state != "compensated" and not kept:
            calls = WORLD.undo_calls.get(run_id, 0) - expected[0]
            self.violation(
                "requeue-ran-no-undo" if calls == 0 else "requeue-did-not-compensate",
                run_id,
                f"requeued with fewer failures left than the compensation's {ATTEMPTS} "
                f"attempts and nothing else injected, yet it ended {state} "
                f"(undo tool called {calls} time(s) since)",
            )

    def check_reversals(self, run_id: str, state: str, escalations: list[EscalationView]) -> None:
        """What a person's answers (and the lack of one) must have led to, and that the SQL
        record of each undo says what Redis says, answers included."""
        undos = self.engine.undos(run_id)
        effects = {e.step: e for e in WORLD.effects_of(run_id)}
        listed_kept = frozenset().union(*(e.kept_steps for e in escalations))
        failed = frozenset().union(*(e.failed_errors for e in escalations))
        for step_, undo in sorted(undos.items()):
            effect = effects.get(step_)
            where = f"step {step_}" + (f" ({effect.tool})" if effect is not None else "")
            people = [d for d, by in undo.decisions if by != "reaper"]
            if undo.state == "kept":
                if not people or people[-1] != "keep":
                    self.violation(
                        "kept-silently", run_id, f"{where} kept, answers {undo.decisions}"
                    )
                if effect is not None and effect.undone_by is not None:
                    self.violation("kept-but-undone", run_id, f"{where} kept, yet undone")
                if step_ not in listed_kept:
                    self.violation(
                        "kept-not-listed", run_id, f"{where} kept: no escalation lists it kept"
                    )
            if undo.state == "done" and effect is not None and effect.undone_by is None:
                self.violation("done-but-live", run_id, f"{where}'s undo done, its effect live")
            unanswered = undo.state == "failed" and undo.error_type == "NotAnswered"
            if unanswered and (state != "escalated" or (step_, "NotAnswered") not in failed):
                self.violation(
                    "unanswered-not-escalated",
                    run_id,
                    f"nobody answered about {where}; the run is {state} and no open "
                    "escalation names it",
                )
            taken = self.decided.get((run_id, step_))
            if taken is not None and taken[0] == "keep" and undo.state != "kept":
                self.violation(
                    "keep-not-kept", run_id, f"{where} kept by a person, now {undo.state}"
                )
            if taken is not None and taken[0] == "reverse" and undo.state in ("asked", "kept"):
                self.violation(
                    "reverse-not-reversed",
                    run_id,
                    f"{where} reversed by a person, now {undo.state}",
                )
        if not self.engine.redis_recorded(run_id):
            return
        recorded = self.engine.sql_undos(run_id)
        for step_, undo in sorted(undos.items()):
            row = recorded.get(step_)
            if row is None or (row.state, row.decisions) != (undo.state, undo.decisions):
                seen = "none" if row is None else f"{row.state} {row.decisions}"
                self.violation(
                    "sql-disagrees-undo",
                    run_id,
                    f"step {step_}'s undo: Redis {undo.state} {undo.decisions}, SQL {seen}",
                )


# =============================================================================================
# Profiles and the CLI.
# =============================================================================================


def profile(examples: int, steps: int, **overrides: Any) -> settings:
    """Hypothesis settings of a model check: no deadline (real Redis, real SQLite), every
    health check off (the examples are slow by design and preconditions filter a lot)."""
    options: dict[str, Any] = {
        "max_examples": examples,
        "stateful_step_count": steps,
        "deadline": None,
        "suppress_health_check": list(HealthCheck),
        "database": None,
        "report_multiple_bugs": False,
        "phases": [Phase.explicit, Phase.generate, Phase.shrink],
        "print_blob": False,
    }
    options.update(overrides)
    return settings(**options)


#: Where ``ModelCheck.say`` writes when a program is replayed outside Hypothesis.
NARRATION: list[str] | None = None
_STEP_LINE = re.compile(r"^state\.(\w+)\((.*)\)$")


class InvalidProgram(Exception):
    """A step of a replayed program cannot run (its precondition does not hold)."""


@dataclass
class Program:
    """A program of rules, as Hypothesis prints a failing test case."""

    steps: list[tuple[str, dict[str, Any]]]
    #: The state machine the program drives.
    machine: type[ModelCheck] | None = None

    @classmethod
    def parse(cls, lines: list[str], machine: type[ModelCheck] | None = None) -> Program:
        steps = []
        for line in lines:
            match = _STEP_LINE.match(line.strip())
            if match and match.group(1) != "teardown":
                # Our own printout: keyword arguments holding ints, bools and strings only.
                arguments = eval(f"dict({match.group(2)})", {"__builtins__": {"dict": dict}})
                steps.append((match.group(1), arguments))
        return cls(steps, machine)

    def lines(self) -> list[str]:
        rendered = ["state = ModelCheck()"]
        for name, arguments in self.steps:
            listed = ", ".join(f"{k}={v!r}" for k, v in sorted(arguments.items()))
            rendered.append(f"state.{name}({listed})")
        return rendered

    def replay(self) -> tuple[Violation | None, list[str]]:
        """Run the program outside Hypothesis: the violation it ends with, and the program
        with what happened at each step."""
        global NARRATION
        NARRATION = []
        transcript: list[str] = []
        kind = self.machine or ModelCheck
        machine = kind()
        violation: Violation | None = None
        try:
            for line, (name, arguments) in zip(self.lines()[1:], self.steps, strict=True):
                rule_ = getattr(getattr(kind, name), "hypothesis_stateful_rule", None)
                if not all(holds(machine) for holds in getattr(rule_, "preconditions", ())):
                    raise InvalidProgram(f"{name}: its precondition does not hold")
                start = len(NARRATION)
                try:
                    getattr(machine, name)(**arguments)
                finally:
                    transcript += [*NARRATION[start:], line]
            start = len(NARRATION)
            try:
                machine.teardown()
            finally:
                transcript += ["state.teardown()", *NARRATION[start:]]
        except Violation as exc:
            violation = exc
            machine.teardown()
        except InvalidProgram:
            machine.failed = True
            machine.teardown()
        finally:
            NARRATION = None
        return violation, ["state = ModelCheck()", *transcript]


def minimize(
    error: Violation, machine: type[ModelCheck] | None = None
) -> tuple[Violation, list[str]] | None:
    """Delete steps from Hypothesis's shrunk program while the same symptom still comes up
    with no fault the original did not have (Hypothesis's shrinker often leaves no-op steps
    in these programs). None if the printed program does not replay to the violation."""
    program = Program.parse(getattr(error, "__notes__", []), machine)
    if not program.steps:
        return None
    best, transcript = program.replay()
    if best is None or best.symptom != error.symptom or not best.touches <= error.touches:
        return None
    changed = True
    while changed:
        changed = False
        for index in range(len(program.steps) - 1, 0, -1):  # keep the initialize step
            shorter = Program(program.steps[:index] + program.steps[index + 1 :], machine)
            found, lines = shorter.replay()
            if (
                found is not None
                and found.symptom == best.symptom
                and found.touches <= best.touches
            ):
                program, best, transcript, changed = shorter, found, lines, True
    return best, transcript


def _stop_now(_signum: int, _frame: Any) -> None:
    stop_resources()
    os._exit(143)


def run_once(
    examples: int,
    steps: int,
    seed: int,
    shrink: bool = True,
    kind: type[ModelCheck] | None = None,
) -> BaseException | None:
    """One Hypothesis run; the exception of its (shrunk) falsifying example, if any."""
    kind = kind or ModelCheck
    machine = hypothesis.seed(seed)(type(kind.__name__, (kind,), {}))
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    test = get_state_machine_test(machine, settings=profile(examples, steps, phases=phases))
    try:
        test()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return exc
    return None


_LAST_LINE = re.compile(r"^modelcheck: (\d+) examples, (\d+) violations$", re.M)


def run_jobs(
    args: argparse.Namespace, argv: list[str], module: str = "tests.reliability.modelcheck"
) -> int:
    """``--jobs N``: N copies of this check, each with ``--seed S*100+j`` and its share of the
    examples, side by side (one per core: each is single-threaded where it counts). Their
    reports are printed one after another; the last line sums them."""
    passed: list[str] = []
    skip = False
    for arg in argv:  # everything but --jobs, --seed and --examples goes through as given
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--jobs", "--seed", "--examples"):
            skip = "=" not in arg
            continue
        passed.append(arg)
    share = -(-args.examples // args.jobs)
    children: list[tuple[int, subprocess.Popen[str], Any]] = []

    def stop(_signum: int, _frame: Any) -> None:
        for _, child, _ in children:
            child.terminate()
        for _, child, _ in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=10)
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    examples = violations = status = 0
    with contextlib.ExitStack() as files:
        for job in range(args.jobs):
            seed = args.seed * 100 + job
            command = [sys.executable, "-m", module, *passed]
            command += ["--seed", str(seed), "--examples", str(share)]
            output = files.enter_context(tempfile.TemporaryFile("w+"))
            children.append((seed, subprocess.Popen(command, stdout=output, text=True), output))
        for seed, child, output in children:
            child.wait()
            output.seek(0)
            report = output.read()
            print(f"\n##### job --seed {seed} (exit status {child.returncode})")
            print(report.rstrip())
            counted = _LAST_LINE.findall(report)
            if not counted:
                print(f"modelcheck: job --seed {seed} gave no count", file=sys.stderr)
                status, violations = 1, violations + 1
                continue
            examples += int(counted[-1][0])
            violations += int(counted[-1][1])
            status = max(status, child.returncode)
    print(f"modelcheck: {examples} examples, {violations} violations")
    return 1 if violations or status else 0


def main(
    argv: list[str] | None = None,
    machine: type[ModelCheck] | None = None,
    module: str = "tests.reliability.modelcheck",
    description: str | None = None,
) -> int:
    """The CLI of this check, or of a sibling (``machine``, run as ``python -m module``)."""
    machine = machine or ModelCheck
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="examples to generate in all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30, help="rules per example at most")
    parser.add_argument(
        "--stop-first", action="store_true", help="stop at the first violation (V is then 1)"
    )
    parser.add_argument("--no-shrink", action="store_true", help="report unshrunk examples")
    parser.add_argument("--rounds", type=int, default=40, help="Hypothesis runs at most")
    parser.add_argument(
        "--shrinks", type=int, default=2000, help="successful shrinks per violation at most"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SYMPTOM[+FAULT,...]",
        help="count only this violation (on a run with at least these faults); repeatable",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="split the examples over this many processes (each its own seed and redis-server)",
    )
    args = parser.parse_args(argv)
    if args.jobs > 1 and os.environ.get(REDIS_URL_ENV):
        parser.error(f"{REDIS_URL_ENV} is one Redis: run one job (--jobs 1) on it")
    if args.jobs > 1:
        return run_jobs(args, list(sys.argv[1:] if argv is None else argv), module)
    for target in args.only:
        symptom, _, faults = target.partition("+")
        CAMPAIGN.targets.append((symptom, frozenset(f for f in faults.split(",") if f)))
    # Hypothesis stops at 500 successful shrinks by default: a 30-step program often still
    # holds steps that do nothing by then. Both limits are documented as monkeypatchable.
    from hypothesis.internal.conjecture import engine as conjecture_engine

    conjecture_engine.MAX_SHRINKS = args.shrinks
    conjecture_engine.MAX_SHRINKING_SECONDS = 240
    # A SIGTERM (a CI timeout) must still stop the private redis-server.
    # (Stopped here and now: Hypothesis and the delivery threads would swallow a SystemExit.)
    signal.signal(signal.SIGTERM, _stop_now)
    found: list[tuple[Sighting, Violation, int]] = []
    other = 0
    with quiet_logs(), running(machine.engine_class):
        for round_number in range(args.rounds):
            remaining = args.examples - CAMPAIGN.generated
            if remaining <= 0:
                break
            seed = args.seed * 1000 + round_number
            CAMPAIGN.start_round()
            error = run_once(remaining, args.steps, seed, not args.no_shrink, machine)
            CAMPAIGN.end_round()
            if error is None:
                break
            if not isinstance(error, Violation) or CAMPAIGN.first_in_round is None:
                print(f"\nmodelcheck: the harness failed (seed {seed}):", file=sys.stderr)
                traceback.print_exception(error)
                other += 1
                break
            # Examples: generated in all (every round so far) up to the one the round stopped
            # on, which Hypothesis then shrank into this violation (it may have shown another
            # symptom first: shrinking slips to the simplest failure).
            first = CAMPAIGN.first_in_round
            minimal = minimize(error, machine)
            transcript = getattr(error, "__notes__", [])
            if minimal is not None:
                error, transcript = minimal[0], ["Minimal program (replayed):", *minimal[1]]
            found.append((first, error, seed))
            CAMPAIGN.mask(error.symptom, error.touches)
            print(f"\n=== violation {len(found)}: {error.symptom}")
            for line in transcript:
                print(line)
            print(f"    {error}")
            print(
                f"    found after {first.examples} example(s), {first.seconds:.1f} s of search "
                f"(--seed {args.seed}: round {round_number}, Hypothesis seed {seed}); the "
                f"unshrunk example showed [{first.symptom}] "
                f"{', '.join(sorted(first.touches)) or 'no faults'}"
            )
            sys.stdout.flush()
            if args.stop_first:
                break
    if found:
        print("\nsummary:")
        for number, (first, error, seed) in enumerate(found, 1):
            faults = ", ".join(sorted(error.touches)) or "no faults"
            print(
                f"  {number}. {error.symptom} [{faults}]: after {first.examples} examples, "
                f"{first.seconds:.1f} s (hypothesis seed {seed})"
            )
    reported = {error.symptom for _, error, _ in found}
    others: dict[str, Sighting] = {}
    for sighting in CAMPAIGN.sightings.values():
        if sighting.symptom not in reported:
            best = others.get(sighting.symptom)
            if best is None or len(sighting.touches) < len(best.touches):
                others[sighting.symptom] = sighting
    if others:
        print("also seen, not reported (while shrinking, or hidden by another violation):")
        for sighting in others.values():
            faults = ", ".join(sorted(sighting.touches)) or "no faults"
            print(f"  - [{sighting.symptom}] {sighting.message[:160]} ({faults})")
    print(f"modelcheck: {CAMPAIGN.generated} examples, {len(found) + other} violations")
    return 1 if found or other else 0


if __name__ == "__main__":
    sys.exit(main())
