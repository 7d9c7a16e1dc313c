"""The ``saga.notify`` task: one delivery of one notice, retried with backoff.

Acknowledged late, so a worker killed mid-delivery hands the message back; the attempts are
counted in the notice's row, across redeliveries, so a crash loop still ends (failed). The
retry delays are in the start-up guard's list (``retry_policy``): each must end before the
visibility timeout, like a tool's.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from saga.celery_amqp import broker_countdown
from saga.constants import NOTIFY_TASK
from saga.errors import NotificationError
from saga.notifications.notifier import Notifier
from saga.notify_settings import NotifySettings
from saga.retry import RetryPolicy


def install_notify_task(app: Celery, notifier: Notifier) -> None:
    @app.task(
        name=NOTIFY_TASK,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=None,  # the notice's row counts the attempts
        ignore_result=True,
        shared=False,
    )
    def notify(self: Task, escalation_id: str, sink: str) -> dict[str, Any]:
        delivery = notifier.deliver(escalation_id, sink)
        if delivery.retry_in is not None:
            # (as every retry: on quorum queues one under a second would be dropped)
            countdown = broker_countdown(self.app.conf, delivery.retry_in)
            raise self.retry(exc=delivery.error, countdown=countdown)
        if delivery.status == "failed":  # recorded; the task fails visibly too (Flower: red)
            raise NotificationError(f"notice {escalation_id} to {sink}: {delivery.detail}")
        return {"status": delivery.status, "detail": delivery.detail}


def retry_policy(settings: NotifySettings) -> RetryPolicy:
    """The longest wait a notice's retry may ask for, for the start-up guard."""
    return settings.retry


def configuration_problems(settings: NotifySettings, conf: Any) -> list[str]:
    """A POST that may outlast the task's time limit would be killed mid-send, every time."""
    limit = float(conf.get("task_time_limit") or 0)
    timeout = settings.timeout
    if settings.webhook_url and limit and timeout >= limit:
        return [
            f"SAGA_NOTIFY_TIMEOUT ({timeout:g}s) is not below task_time_limit ({limit:g}s): "
            "a slow webhook would be killed mid-send on every attempt"
        ]
    return []
