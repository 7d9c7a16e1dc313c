"""For web apps: start hosted agent runs, watch them, stop them, with nothing but the broker's
and Redis's URLs. No tool code is imported: turns are sent to the workers by task name.

    from saga import client
    run_id = client.enqueue_run("refund", "Refund order 4921, it arrived late.")
    client.get_run(run_id).state          # "running", then "completed", ...

An asyncio app awaits the same calls from ``saga.aio``, which shares this module's checks,
errors and messages (the functions after ``Client``): a change to them reaches both.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from celery import Celery

from saga.agents.launch import Launched, launch_run, published_agent, send_turn
from saga.agents.turn_state import LoopState, document
from saga.celery_amqp import amqp_settings
from saga.constants import START_UNWIND_TASK, TURN_QUEUE
from saga.errors import ApprovalError, MessageNotSentError, RunEndedError, UnknownRunError
from saga.listing import RunFilter, RunRow, page_of_runs
from saga.model import CompensationState, RunState
from saga.picture import RunPicture
from saga.redis_urls import is_tls, kombu_url, sentinel_transport_options
from saga.rules import not_undone
from saga.settings import Settings, broker_url_from_env, check_not_cluster
from saga.stack import Outcome, RunStore, reachable
from saga.transport import use_pooled_client_transport
from saga.validation import check_agent_name, check_deadline, check_name, check_text

__all__ = [
    "Client",
    "RunStatus",
    "RunSummary",
    "abort_run",
    "approve",
    "deny",
    "enqueue_run",
    "get_run",
    "list_runs",
]

logger = logging.getLogger("saga.client")


@dataclass(frozen=True)
class RunStatus:
    """A hosted run as a web page shows it; ``to_dict()`` is plain JSON."""

    run_id: str
    agent: str
    state: str
    reason: str
    cause: str
    pivot_step: int | None
    turns: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    stack: list[dict[str, Any]]
    usage: dict[str, int]
    model_calls: int
    #: Set when the run escalated: what a person must look at.
    escalation: dict[str, Any] | None = None
    #: Why the loop stopped ("final answer", a limit, a model error); '' while it runs.
    ended: str = ""
    input: str = ""
    final_text: str = ""
    #: Calls waiting for a person (``approve`` / ``deny`` them by ``id``, with ``args_hash``).
    pending_approvals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def awaiting_approval(self) -> bool:
        return self.state == "running" and bool(self.pending_approvals)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "awaiting_approval": self.awaiting_approval}


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    agent: str
    state: str
    created: float


class Client:
    """Talks to the broker (to send turns and unwinds by name) and to the saga's Redis."""

    def __init__(
        self,
        broker_url: str | None = None,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        self.settings, redis_url, broker_url = resolved(broker_url, redis_url, settings)
        self.store = RunStore.for_settings(self.settings, redis_url)
        self.app = broker_app(broker_url, redis_url)

    def enqueue_run(
        self, agent: str, input: str, run_id: str | None = None, deadline: float | None = None
    ) -> str:
        """Start a run of ``agent`` on the workers; returns its id at once. The same
        ``run_id`` twice starts one run. ``deadline`` (seconds without progress before the
        reaper resolves the run, and an approval expires): default, the agent's own, as the
        workers published it, else ``SAGA_RUN_DEADLINE`` until the turn worker gives the run
        its agent's own as it plays the first turn.

        An agent no worker hosts is refused here (``UnknownAgentError``) once any worker has
        published the agents it hosts; before that, the turn worker ends such a run
        ``failed_to_start``. ``MessageNotSentError``: the run is created (its ``run_id``) but
        its first turn is not sent; call again with that ``run_id`` to send it (never
        without: that is another run)."""
        return self.launch(agent, input, run_id, deadline).run_id

    def launch(
        self, agent: str, input: str, run_id: str | None = None, deadline: float | None = None
    ) -> Launched:
        """``enqueue_run``, saying also whether this call created the run (for an API that
        answers 201 to the one that did and 200 to the others)."""
        check_agent_name(agent)
        with reachable("enqueue_run"):  # a broker refusal is MessageNotSentError within
            chosen, open_deadline = run_deadline(
                published_agent(self.store, agent), deadline, self.settings
            )
            return launch_run(
                self.store,
                self.app,
                agent,
                input,
                run_id,
                chosen,
                self.settings.max_payload_bytes,
                deadline_open=open_deadline,
            )

    def get_run(self, run_id: str) -> RunStatus:
        picture = self.store.picture(run_id)
        if picture is None:
            raise no_run(run_id)
        return status_of(picture)

    def list_runs(self, agent: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Hosted runs whose keys are still in Redis (running, or within their retention),
        newest first (``saga.listing`` pages through all runs, with SQL's too)."""
        found: list[RunSummary] = []
        cursor: str | None = None
        while len(found) < limit:
            with reachable("list_runs"):
                page = page_of_runs(self.store, None, RunFilter(agent=agent, limit=limit), cursor)
            found += summaries(page.rows)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return found[:limit]

    def approve(self, run_id: str, approval_id: str, *, args_hash: str, by: str) -> bool:
        """Let the call ``approval_id`` (``<turn>:<call>``) go out, as shown: ``args_hash`` is
        the hash of the arguments the person saw. Single use; expires with the run. The same
        decision again by the same person is not refused: it answers False (applied already)
        and sends the turn that acts on it again (after a ``MessageNotSentError``)."""
        return self._decide(run_id, approval_id, "approved", by, "", args_hash)

    def deny(self, run_id: str, approval_id: str, reason: str, *, args_hash: str, by: str) -> bool:
        """Refuse the call; the model is told ``reason`` and goes on. True, False and a repeat
        as ``approve``."""
        return self._decide(run_id, approval_id, "denied", by, reason, args_hash)

    def _decide(
        self, run_id: str, marker: str, verdict: str, by: str, reason: str, args_hash: str
    ) -> bool:
        check_decision(by, reason)
        outcome = self.store.decide_approval(run_id, marker, verdict, by, reason, args_hash)
        if decision_refusal(outcome.status):
            raise approval_refused(run_id, marker, outcome.status)
        if outcome.status == "repeat" and outcome.values[1] != RunState.RUNNING.value:
            return False  # the run went on past that turn, and ended: nothing to send
        try:
            send_turn(self.app, run_id, turn_of(marker))  # the turn goes on
        except Exception as exc:
            raise decision_not_sent(run_id, marker, verdict, exc) from exc
        return outcome.status == "ok"

    def abort_run(self, run_id: str, reason: str = "aborted by the user") -> bool:
        """Stop the run now: no more turns; the workers unwind what it did (or escalate past
        its pivot) once its steps in flight settle. The same abort again (the same reason)
        is not refused: it answers False (applied already) and sends the unwind again if it
        is still unsent (after a ``MessageNotSentError``)."""
        outcome = self.store.abort(run_id, abort_reason(reason))
        if must_unwind(run_id, outcome):
            try:
                send_unwind(self.app, run_id)
            except Exception as exc:
                raise unwind_not_sent(run_id, exc) from exc
        return outcome.status == "ok"


# -- what the sync client and the asyncio one (``saga.aio``) share ---------------------------


def resolved(
    broker_url: str | None, redis_url: str | None, settings: Settings | None
) -> tuple[Settings, str, str]:
    """The settings, the Redis URL and the broker's (``SAGA_BROKER_URL`` with its password,
    else the Redis)."""
    settings = settings or Settings.from_env()
    redis_url = redis_url or settings.redis_url
    return settings, redis_url, broker_url or broker_url_from_env(redis_url)


def broker_app(broker_url: str, redis_url: str = "") -> Celery:
    """A Celery app that only sends, by task name: no tool code is imported. A Sentinel
    broker's master is ``SAGA_REDIS_SENTINEL_MASTER``, else the one ``redis_url`` names."""
    check_not_cluster("the broker's URL", broker_url)
    kombu = kombu_url(broker_url)
    app = Celery("saga-client", broker=kombu, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
    )
    sentinel = sentinel_transport_options(redis_url or broker_url, kombu)
    if sentinel:
        app.conf.broker_transport_options = sentinel
    # On RabbitMQ, the workers' queues as they declare them (a publish declares its queue, and
    # one of another type is refused), and publisher confirms.
    app.conf.update(amqp_settings(broker_url))
    use_pooled_client_transport(app)
    if is_tls(broker_url):
        app.conf.broker_use_ssl = {
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
            "ssl_ca_certs": os.environ.get("SAGA_REDIS_SSL_CA"),
            "ssl_certfile": os.environ.get("SAGA_REDIS_SSL_CERT"),
            "ssl_keyfile": os.environ.get("SAGA_REDIS_SSL_KEY"),
        }
    return app


def run_deadline(
    hosted: dict[str, Any] | None, deadline: float | None, settings: Settings
) -> tuple[float, bool]:
    """The deadline a new run starts on (``enqueue_run`` says which), and whether it is open:
    a guess the turn worker replaces with the agent's own (nothing was published)."""
    open_deadline = deadline is None and hosted is None
    if deadline is None:
        deadline = (hosted or {}).get("deadline") or settings.run_deadline_seconds
    return check_deadline(deadline), open_deadline


def no_run(run_id: str) -> UnknownRunError:
    return UnknownRunError(f"no run {run_id} (never started, or expired)")


def summaries(rows: Iterable[RunRow]) -> list[RunSummary]:
    """The hosted runs among a listing's rows (``run.call``'s have no agent)."""
    return [RunSummary(r.run_id, r.agent, r.state, r.created or 0.0) for r in rows if r.agent]


def check_decision(by: str, reason: str) -> None:
    check_name("by", by)
    check_text("reason", reason, max_length=2000)


def turn_of(marker: str) -> int:
    """The turn an approval's id (``<turn>:<call>``) belongs to: the one a decision resumes."""
    return int(marker.split(":")[0])


def decision_refusal(status: str) -> str:
    """Why ``decide_approval.lua`` refused a decision ('' when it stands: taken now, or this
    very decision repeated, and the turn that acts on it is to be sent)."""
    if status in ("ok", "repeat"):
        return ""
    return {
        "unknown": "no call awaits approval under this id",
        "decided": "it was decided already",
        "ended": "the run is no longer running",
        "mismatch": "the arguments are not the ones awaiting approval",
        "expired": "the request expired with the run's deadline",
    }.get(status, status)


def approval_refused(run_id: str, marker: str, status: str) -> ApprovalError:
    return ApprovalError(f"run {run_id}, call {marker}: {decision_refusal(status)}")


def decision_not_sent(
    run_id: str, marker: str, verdict: str, exc: Exception
) -> MessageNotSentError:
    logger.error("run %s: the broker did not take the turn of %s (%r)", run_id, marker, exc)
    return MessageNotSentError(
        run_id, f"call {marker} {verdict}", "turn", "the same decision again"
    )


def abort_reason(reason: str) -> str:
    """The reason an abort records, once the caller's is valid."""
    return f"aborted: {check_text('reason', reason, max_length=2000)}"


def must_unwind(run_id: str, outcome: Outcome) -> bool:
    """What the abort script answered: True when this caller must send the unwind (a first
    abort, or the same abort again after its unwind was refused); ``UnknownRunError`` /
    ``RunEndedError`` when there was nothing to abort."""
    if outcome.status == "unknown":
        raise UnknownRunError(f"no run {run_id}")
    if outcome.status == "ended":
        raise RunEndedError(run_id, str(outcome.values[0]))
    return outcome.owns_unwind


def send_unwind(app: Celery, run_id: str) -> None:
    app.send_task(START_UNWIND_TASK, kwargs={"run_id": run_id, "owner": "abort"}, queue=TURN_QUEUE)


def unwind_not_sent(run_id: str, exc: Exception) -> MessageNotSentError:
    logger.error("run %s: the broker did not take its unwind (%r)", run_id, exc)
    return MessageNotSentError(
        run_id, "aborted", "unwind", "the same abort again (the same reason)"
    )


def status_of(picture: RunPicture) -> RunStatus:
    """The picture of a run, as ``get_run`` answers it."""
    hosted = document(picture) or {}
    state = LoopState.parse(picture.agent)
    escalation = None
    if picture.state is RunState.ESCALATED:
        escalation = {
            "reason": picture.reason,
            "cause": picture.cause,
            "not_undone": not_undone(picture),
            "failed_compensations": [
                {"step": c.step, "undo": c.entry, "error": c.error}
                for c in picture.compensations
                if c.state is CompensationState.FAILED
            ],
        }
    turns = hosted.get("turns", [])
    final = turns[-1]["text"] if turns and not turns[-1]["calls"] else ""
    return RunStatus(
        run_id=picture.run_id,
        agent=state.agent if state else "",
        state=picture.state.value,
        reason=picture.reason,
        cause=picture.cause,
        pivot_step=picture.pivot_step,
        turns=turns,
        steps=[
            {**asdict(s), "tool_class": int(s.tool_class), "state": s.state.value}
            for s in picture.steps
        ],
        stack=picture.stack,
        usage=hosted.get("usage", {"input_tokens": 0, "output_tokens": 0}),
        model_calls=int(hosted.get("model_calls", 0)),
        escalation=escalation,
        ended=str(hosted.get("ended", "")),
        input=str(hosted.get("input", "")),
        final_text=final,
        pending_approvals=list(hosted.get("pending_approvals", [])),
    )


@functools.cache
def default_client() -> Client:
    """A client from the environment (``SAGA_BROKER_URL``, ``SAGA_REDIS_URL``, ...)."""
    return Client()


def enqueue_run(
    agent: str, input: str, run_id: str | None = None, deadline: float | None = None
) -> str:
    return default_client().enqueue_run(agent, input, run_id, deadline)


def get_run(run_id: str) -> RunStatus:
    return default_client().get_run(run_id)


def list_runs(agent: str | None = None, limit: int = 50) -> list[RunSummary]:
    return default_client().list_runs(agent, limit)


def abort_run(run_id: str, reason: str = "aborted by the user") -> None:
    default_client().abort_run(run_id, reason)


def approve(run_id: str, approval_id: str, *, args_hash: str, by: str) -> None:
    default_client().approve(run_id, approval_id, args_hash=args_hash, by=by)


def deny(run_id: str, approval_id: str, reason: str, *, args_hash: str, by: str) -> None:
    default_client().deny(run_id, approval_id, reason, args_hash=args_hash, by=by)
