"""Escalation notices: the ERROR log always, plus the sinks set in ``SAGA_NOTIFY_*``: a Python
callable and a signed webhook, each delivered by a Celery task (``saga.notify``) with retries,
never lost to a crash, and recorded when a sink never takes it (docs/notifications.md).

Receivers of the webhook check it with ``verify`` (or the ten lines it documents).
"""

from saga.errors import NotificationError, SignatureError
from saga.notifications.body import SCHEMA_VERSION, notification_body
from saga.notifications.signing import (
    DEFAULT_TOLERANCE,
    NOTICE_ID_HEADER,
    SIGNATURE_HEADER,
    sign,
    verify,
)
from saga.notifications.store import NoticeRecord, NoticeState
from saga.notify_settings import CALLABLE, WEBHOOK, NotifySettings

__all__ = [
    # Settings
    "CALLABLE",
    "WEBHOOK",
    "NotifySettings",
    # What is sent
    "SCHEMA_VERSION",
    "notification_body",
    # Receiving a webhook
    "DEFAULT_TOLERANCE",
    "NOTICE_ID_HEADER",
    "SIGNATURE_HEADER",
    "sign",
    "verify",
    "SignatureError",
    # What became of each notice
    "NoticeRecord",
    "NoticeState",
    "NotificationError",
]
