"""What saga sets when the broker is RabbitMQ (``amqp://``, ``amqps://``, ``pyamqp://``).

Why these settings:
- Quorum queues: replicated, so a broker node lost takes no step with it; and they are what
  RabbitMQ keeps improving (classic mirrored queues are gone in 4.0). ``SAGA_RABBITMQ_QUEUE_TYPE=
  classic`` keeps classic queues for a broker that already has them and cannot migrate yet.
- A topic exchange (``saga``) for every queue: Celery's native delayed delivery (5.5+) parks a
  retry's countdown in the broker's own delay queues, routed by topic; on a direct exchange it
  logs "Direct exchanges are not supported" and the worker holds the message for its countdown
  instead, counting against RabbitMQ's consumer timeout. The exchange is not Celery's
  ``celery`` (direct by default), so a broker that served a plain Celery app before is not
  refused for the exchange's type.
- The queues are declared in ``task_queues`` with those arguments: Celery uses native delayed
  delivery only for queues it knows as quorum (``app.amqp.queues``), in the worker that sends
  the retry and in every caller that sends a step.
- Publisher confirms: a publish returns once the broker has the message, not once it is
  written to a socket, so a step the caller believes sent is in the queue.

The consumer timeout (RabbitMQ cancels a delivery held unacknowledged longer, 30 minutes by
default) cannot be read over AMQP; ``SAGA_RABBITMQ_CONSUMER_TIMEOUT`` says what the broker's
is, and the worker's start-up guard checks every tool's longest hold against it.
"""

from __future__ import annotations

import os
from typing import Any

from kombu.entity import Exchange, Queue

from saga.constants import TURN_QUEUE
from saga.settings import is_amqp_url

__all__ = [
    "CONSUMER_TIMEOUT_ENV",
    "DEFAULT_CONSUMER_TIMEOUT",
    "EXCHANGE",
    "QUEUE_TYPE_ENV",
    "TOOL_QUEUE",
    "amqp_settings",
    "broker_countdown",
    "consume_turns_only_when_named",
    "consumer_timeout",
    "is_amqp_url",
    "queue_type",
    "task_queues",
]

QUEUE_TYPE_ENV = "SAGA_RABBITMQ_QUEUE_TYPE"
CONSUMER_TIMEOUT_ENV = "SAGA_RABBITMQ_CONSUMER_TIMEOUT"
#: RabbitMQ's own default ``consumer_timeout`` (since 3.8.15): 30 minutes.
DEFAULT_CONSUMER_TIMEOUT = 1800.0
#: Celery's default queue: every tool call and every compensation.
TOOL_QUEUE = "celery"
EXCHANGE = "saga"
_QUEUE_TYPES = ("quorum", "classic")


def queue_type() -> str:
    """``SAGA_RABBITMQ_QUEUE_TYPE``: quorum unless told classic; a typo is refused here
    rather than becoming a queue of a type nobody chose."""
    raw = os.environ.get(QUEUE_TYPE_ENV, "").strip().lower() or "quorum"
    if raw not in _QUEUE_TYPES:
        raise ValueError(f"{QUEUE_TYPE_ENV} must be quorum or classic, got {raw!r}")
    return raw


def consumer_timeout() -> float:
    """The broker's ``consumer_timeout`` in seconds, as ``SAGA_RABBITMQ_CONSUMER_TIMEOUT``
    says (RabbitMQ 3.10 does not tell a client)."""
    raw = os.environ.get(CONSUMER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CONSUMER_TIMEOUT
    try:
        return float(raw)
    except ValueError:
        message = f"{CONSUMER_TIMEOUT_ENV} must be a number of seconds, got {raw!r}"
        raise ValueError(message) from None


def task_queues(kind: str) -> tuple[Queue, ...]:
    """The tool and turn queues, durable, of ``kind``, bound to the topic exchange by their
    own names (so the delayed-delivery bindings, ``#.<name>``, find them)."""
    exchange = Exchange(EXCHANGE, type="topic", durable=True)  # type: ignore[no-untyped-call]
    arguments = {"x-queue-type": "quorum"} if kind == "quorum" else None
    made = (
        Queue(name, exchange, routing_key=name, durable=True, queue_arguments=arguments)  # type: ignore[no-untyped-call]
        for name in (TOOL_QUEUE, TURN_QUEUE)
    )
    return tuple(made)


def amqp_settings(broker_url: str, kind: str | None = None) -> dict[str, Any]:
    """The Celery settings a RabbitMQ broker gets (empty for any other broker): the queues,
    the exchange, and queues an app adds of its own created of the same kind."""
    if not is_amqp_url(broker_url):
        return {}
    kind = kind or queue_type()
    return {
        "task_queues": task_queues(kind),
        "task_default_exchange": EXCHANGE,
        "task_default_exchange_type": "topic",
        "task_default_queue_type": kind,
        "task_create_missing_queue_type": kind,
        "task_create_missing_queue_exchange_type": "topic",
        "broker_transport_options": {"confirm_publish": True},
    }


def consume_turns_only_when_named(queues: Any) -> bool:
    """A worker started without ``-Q`` consumes every queue of ``task_queues``: on RabbitMQ
    that is the turn queue too, so a tool worker would take turns with prefork slots (or fail
    them, when its app hosts no agents). As on Redis, where only the default queue is known, it
    consumes the tool queue alone; ``-Q celery,saga.turns`` still takes both. ``queues``: the
    worker's ``app.amqp.queues`` once ``-Q`` and ``-X`` are applied (``celeryd_after_setup``).
    True if it left the turn queue out."""
    # (Celery keeps no public record of whether -Q was given: no selection is ``None``.)
    if getattr(queues, "_consume_from", ...) is not None or TURN_QUEUE not in queues:
        return False
    queues.deselect(TURN_QUEUE)
    return True


def broker_countdown(conf: Any, countdown: float) -> float:
    """A retry's countdown as the broker can take it. On quorum queues Celery (5.7) parks the
    countdown in the delay queues by whole seconds and refuses one that truncates to none: the
    retry is rejected and its message dropped. There, a countdown under a second waits one
    (the worker holds nothing meanwhile); elsewhere it is left as asked."""
    if 0 < countdown < 1 and is_amqp_url(str(conf.get("broker_url") or "")):
        queues = conf.get("task_queues") or ()
        if any((q.queue_arguments or {}).get("x-queue-type") == "quorum" for q in queues):
            return 1.0
    return countdown
