"""The demo's Celery app plus four plain tasks doing the demo tools' work, so that one worker
(``celery -A benchmarks.bench_app worker``) serves both modes of ``benchmarks/overhead.py``.

The plain tasks call the same ``tasks.systems`` functions with a unique idempotency key per
step, as the saga tools do, and take the saga tool tasks' options (late ack, reject on worker
lost, no stored result): what is left between the two modes is saga itself.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis

from tasks import systems
from tasks.app import app, saga

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


@app.task(name="bench.get_order", **_OPTIONS)
def get_order(order_id: int) -> dict[str, Any]:
    return systems.get_order(order_id)


@app.task(name="bench.issue_credit", **_OPTIONS)
def issue_credit(order: dict[str, Any], amount_cents: int, key: str) -> dict[str, Any]:
    return systems.issue_credit(order["order_id"], amount_cents, f"{key}:2", "bench")


@app.task(name="bench.set_ticket_status", **_OPTIONS)
def set_ticket_status(_credit: dict[str, Any], ticket_id: int, status: str, key: str) -> Any:
    return systems.set_ticket_status(ticket_id, status, f"{key}:3")


@app.task(name="bench.send_reply", **_OPTIONS)
def send_reply(_ticket: dict[str, Any], to: str, subject: str, body: str, key: str) -> Any:
    result = systems.send_mail(to, subject, body, f"{key}:4")
    # Completion is one pushed Redis write, waited on with a blocking pop: no polling, and no
    # thread-safety doubts about sharing Celery's result consumer between driver threads. It
    # costs what a stored result + pub/sub notification would (AsyncResult.get), so if
    # anything it favours the bare chain.
    with _redis().pipeline() as pipe:
        pipe.lpush(DONE_PREFIX + key, json.dumps(result))
        pipe.expire(DONE_PREFIX + key, 600)
        pipe.execute()
    return result
