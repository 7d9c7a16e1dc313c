"""What the broker holds of saga's queues: which kind of broker it is, how many messages wait
in each queue and who consumes them, and, on RabbitMQ, whether a queue saga declares already
exists with other arguments (a classic queue where saga wants a quorum one).

Every look is read-only: a queue that does not exist is reported, never created, so ``saga
doctor`` can ask as often as it likes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from saga.celery_amqp import QUEUE_TYPE_ENV
from saga.settings import is_amqp_url

BrokerKind = Literal["redis", "sentinel", "amqp", "other"]

#: AMQP reply codes: the queue does not exist; it exists with other arguments.
_NOT_FOUND = 404
_PRECONDITION_FAILED = 406


@dataclass(frozen=True)
class QueueState:
    name: str
    #: None: the queue does not exist yet (a worker declares it as it starts consuming).
    messages: int | None
    #: The broker's count on RabbitMQ; on Redis there is none (the workers' replies say).
    consumers: int | None


def broker_kind(url: str) -> BrokerKind:
    """The broker a URL names, by its scheme (``redis``, ``rediss`` and ``unix`` are Redis)."""
    scheme = url.partition("://")[0].lower()
    if is_amqp_url(url):
        return "amqp"
    if scheme == "sentinel":
        return "sentinel"
    if scheme in ("redis", "rediss", "unix"):
        return "redis"
    return "other"


def queue_states(app: Any, names: Iterable[str]) -> list[QueueState]:
    """Each queue's waiting messages (and consumers, where the broker counts them)."""
    states = []
    with app.connection_for_write() as connection:
        amqp = connection.transport.driver_type == "amqp"
        for name in names:
            channel = connection.channel()
            try:
                # Passive on RabbitMQ (it creates nothing); on Redis a declaration only
                # names the lists, and a passive one would call an empty queue missing.
                _, messages, consumers = channel.queue_declare(queue=name, passive=amqp)
            except Exception as exc:
                if _reply_code(exc) != _NOT_FOUND:
                    raise
                states.append(QueueState(name, None, None))
                continue
            finally:
                _close(channel)
            states.append(QueueState(name, int(messages), int(consumers) if amqp else None))
    return states


def queue_conflicts(app: Any) -> list[str]:
    """RabbitMQ refuses to declare a queue again with other arguments (``PRECONDITION_FAILED``
    closes the channel), so a worker whose queue exists as classic while it wants quorum (or
    the reverse) would fail as it starts consuming, in a loop. Said here, before, with what
    to do about it. Queues that do not exist yet are no conflict. Empty off RabbitMQ."""
    problems: list[str] = []
    with app.connection_for_write() as connection:
        if connection.transport.driver_type != "amqp":
            return problems
        for queue in app.amqp.queues.values():
            if getattr(queue, "exclusive", False) or queue.auto_delete:
                continue  # Celery's own reply and broadcast queues
            problem = _conflict(connection, queue)
            if problem:
                problems.append(problem)
    return problems


def _conflict(connection: Any, queue: Any) -> str | None:
    channel = connection.channel()
    try:
        channel.queue_declare(queue=queue.name, passive=True)
    except Exception as exc:
        if _reply_code(exc) == _NOT_FOUND:
            return None  # declared by the first worker, with saga's arguments
        raise
    finally:
        _close(channel)
    channel = connection.channel()
    try:
        # It exists: declaring it as saga would tells whether the arguments agree (and,
        # when they do, changes nothing).
        channel.queue_declare(
            queue=queue.name,
            durable=queue.durable,
            auto_delete=queue.auto_delete,
            arguments=queue.queue_arguments,
        )
    except Exception as exc:
        if _reply_code(exc) != _PRECONDITION_FAILED:
            raise
        wanted = (queue.queue_arguments or {}).get("x-queue-type", "classic")
        return (
            f"RabbitMQ queue {queue.name!r} exists with other arguments than saga declares "
            f"(a {wanted} queue): {getattr(exc, 'reply_text', exc)}. A queue's type cannot "
            f"change in place: stop its workers, let callers drain it (or move its messages), "
            f"delete it (`rabbitmqctl delete_queue {queue.name}`), and start a worker, which "
            f"declares it again; or keep the old type with {QUEUE_TYPE_ENV}="
            f"{'classic' if wanted == 'quorum' else 'quorum'} (docs/deployment.md, RabbitMQ)"
        )
    finally:
        _close(channel)
    return None


def _reply_code(exc: BaseException) -> int | None:
    """The AMQP reply code of a channel error (py-amqp's and kombu's virtual transports')."""
    code = getattr(exc, "reply_code", None) or getattr(exc, "code", None)
    if code is None and type(exc).__name__ == "ChannelError" and "NOT_FOUND" in str(exc):
        return _NOT_FOUND
    return int(code) if isinstance(code, int) else None


def _close(channel: Any) -> None:
    """A channel the broker closed (after a refusal) may refuse to close again: no matter."""
    with contextlib.suppress(Exception):
        channel.close()
