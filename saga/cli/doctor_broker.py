"""``saga doctor``'s look at the broker: which kind it is (Redis, Sentinel, RabbitMQ), whether
it answers, and saga's queues on it: the messages waiting and who consumes them (RabbitMQ
counts its consumers; on Redis the workers' replies say which queues they serve), and, on
RabbitMQ, a queue declared as another type than saga declares.

Also what every check of ``saga doctor`` is: a ``Check``, and a probe that turns a check that
could not look into a finding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from saga.cli.context import mask
from saga.constants import TURN_QUEUE

# Types only: a command imports these on use (``saga --help`` loads none of them).
if TYPE_CHECKING:
    from celery import Celery

    from saga.engine import Saga

Status = Literal["ok", "warn", "fail", "skip"]
#: Seconds any one probe may take: a doctor that hangs on a dead service helps nobody.
TIMEOUT = 3.0


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    #: The service did not answer (exit 4 rather than 1).
    unreachable: bool = False


def probe(name: str, look: Callable[[], Check]) -> Check:
    try:
        return look()
    except Exception as exc:  # a check that cannot look is a finding, not a traceback
        return Check(name, "fail", f"could not check: {type(exc).__name__}: {exc}")


def broker_url(saga: Saga | None, redis_url: str) -> str:
    if saga is not None:
        return str(saga.app.conf.broker_url or redis_url)
    from saga.settings import broker_url_from_env  # (not at import: `saga --help` is light)

    return broker_url_from_env(redis_url)


def bare_app(url: str) -> Celery:
    """A Celery app that only talks to the broker (no app was named): pings, queues; on
    RabbitMQ with saga's queues, so their arguments are checked as a worker declares them."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from celery import Celery

    from saga.celery_amqp import amqp_settings
    from saga.redis_urls import kombu_url, sentinel_transport_options

    app = Celery("saga-doctor", broker=kombu_url(url), set_as_current=False)
    app.conf.update(accept_content=["json"], task_serializer="json", **amqp_settings(url))
    sentinel = sentinel_transport_options(os.environ.get("SAGA_REDIS_URL", ""), kombu_url(url))
    if sentinel:  # a Sentinel broker: its master's name (docs/deployment.md, "Sentinel")
        app.conf.broker_transport_options = sentinel
    return app


def broker_check(app: Celery, url: str) -> Check:
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.broker_queues import broker_kind

    kind = broker_kind(url)

    def look() -> Check:
        connection = app.connection_for_write()  # with the app's TLS and transport options
        try:
            connection.ensure_connection(
                max_retries=1,
                interval_start=0,
                interval_step=0.2,
                interval_max=0.2,
                timeout=TIMEOUT,
            )
        except Exception as exc:
            return Check("broker", "fail", f"{kind} at {mask(url)} does not answer: {exc}", True)
        finally:
            connection.release()
        return Check("broker", "ok", f"{kind} at {mask(url)} answers")

    return probe("broker", look)


def queues_check(app: Celery, served: Mapping[str, int] | None) -> Check:
    """Each of saga's queues: messages waiting, consumers. ``served``: how many workers
    answered as consuming each queue (None: none was asked)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.broker_queues import queue_conflicts, queue_states

    def look() -> Check:
        default = str(app.conf.task_default_queue or "celery")
        names = sorted({default, TURN_QUEUE, *app.amqp.queues})
        found = []
        for state in queue_states(app, names):
            if state.messages is None:
                found.append(f"{state.name}: not declared yet")
                continue
            consumers = state.consumers
            if consumers is None:  # Redis: the workers that said they serve it
                consumers = (served or {}).get(state.name, 0)
            found.append(f"{state.name}: {state.messages} message(s), {consumers} consumer(s)")
        conflicts = queue_conflicts(app)
        if conflicts:
            return Check("queues", "fail", "; ".join(conflicts + found))
        return Check("queues", "ok", "; ".join(found))

    return probe("queues", look)
