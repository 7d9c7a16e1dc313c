"""The demo's Celery app plus plain tasks doing the demo tools' work, so that one worker
(``celery -A benchmarks.bench_app worker``) serves every mode of ``benchmarks/overhead.py`` and
``benchmarks/peers.py``.

The plain tasks do the same work (``benchmarks.steps``, one idempotency key per step) as the
saga tools, and take the saga tool tasks' options (late ack, reject on worker lost, no stored
result): what is left between the two modes is saga itself.

The failing path: the fourth step bounces (``steps.bounce``). A saga run unwinds its two undos
(``send_reply_bounced`` joins the demo's tools here, before the app's ``Saga`` is built); the
bare chain's fourth task sends the same two undos as a chain itself, then fails.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import chain

from benchmarks import steps
from saga import RetryPolicy, StepContext, ToolClass
from tasks.tools import tools


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=RetryPolicy(attempts=1))
def send_reply_bounced(ctx: StepContext, to: str, subject: str, body: str) -> dict[str, Any]:
    """The benchmark's failing fourth step."""
    steps.bounce(to, ctx.idempotency_key)
    return {}


from tasks.app import app, saga  # noqa: E402 - after the bench tool joined the registry

__all__ = ["DONE_PREFIX", "app", "saga"]

#: The chain's last task pushes its result to ``DONE_PREFIX + key``; the driver BLPOPs it.
DONE_PREFIX = "bench:done:"
_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "ignore_result": True,
    "shared": False,
}
_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    """One client per worker process, made after the fork."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["SAGA_REDIS_URL"])
    return _client


def _done(key: str, result: Any) -> None:
    # Completion is one pushed Redis write, waited on with a blocking pop: no polling, and no
    # thread-safety doubts about sharing Celery's result consumer between driver threads. It
    # costs what a stored result + pub/sub notification would (AsyncResult.get), so if
    # anything it favours the bare chain.
    with _redis().pipeline() as pipe:
        pipe.lpush(DONE_PREFIX + key, json.dumps(result))
        pipe.expire(DONE_PREFIX + key, 600)
        pipe.execute()


@app.task(name="bench.get_order", **_OPTIONS)
def get_order(order_id: int) -> dict[str, Any]:
    return steps.get_order(order_id)


@app.task(name="bench.issue_credit", **_OPTIONS)
def issue_credit(order: dict[str, Any], amount_cents: int, key: str) -> dict[str, Any]:
    return steps.issue_credit(order["order_id"], amount_cents, key)


@app.task(name="bench.set_ticket_status", **_OPTIONS)
def set_ticket_status(credit: dict[str, Any], ticket_id: int, status: str, key: str) -> Any:
    return {"credit": credit, "ticket": steps.set_ticket_status(ticket_id, status, key)}


@app.task(name="bench.send_reply", **_OPTIONS)
def send_reply(done: dict[str, Any], to: str, subject: str, body: str, key: str) -> Any:
    result = steps.send_reply(to, key)
    _done(key, result)
    return result


@app.task(name="bench.send_reply_bounced", **_OPTIONS)
def send_reply_bounced_task(done: dict[str, Any], to: str, key: str) -> Any:
    """Fails, after sending the undos of steps 3 and 2 (newest first) as one chain."""
    try:
        steps.bounce(to, key)
    except steps.BouncedError:
        ticket, credit = done["ticket"], done["credit"]
        chain(
            restore_status.si(ticket["ticket_id"], ticket["previous"], key),
            reverse_credit.si(credit["credit_id"], key),
        ).apply_async()
        raise
    return None


@app.task(name="bench.restore_status", **_OPTIONS)
def restore_status(ticket_id: int, status: str, key: str) -> Any:
    return steps.restore_status(ticket_id, status, key)


@app.task(name="bench.reverse_credit", **_OPTIONS)
def reverse_credit(credit_id: str, key: str) -> Any:
    result = steps.reverse_credit(credit_id, key)
    _done(key, result)
    return result
