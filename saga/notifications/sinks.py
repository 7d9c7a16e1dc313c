"""The two sinks: a Python callable, and a signed JSON POST to a webhook.

Each returns a short description of what it got (``HTTP 204``) or raises ``NotificationError``
(retried by the task, then recorded). Neither ever puts the webhook's URL or secret in an
error: a chat webhook's URL is itself a credential.
"""

from __future__ import annotations

import importlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from saga.errors import ConfigurationError, NotificationError
from saga.notifications.settings import CALLABLE, WEBHOOK, NotifySettings
from saga.notifications.signing import NOTICE_ID_HEADER, SIGNATURE_HEADER, sign

ATTEMPT_HEADER = "Saga-Delivery-Attempt"
Sink = Callable[[NotifySettings, dict[str, Any], str, int], str]


def encode(body: dict[str, Any]) -> bytes:
    """The bytes that are signed and sent (compact, keys sorted, UTF-8)."""
    return json.dumps(body, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def resolve(spec: str) -> Callable[[dict[str, Any]], Any]:
    """``"package.module:function"`` → the function (imported in the delivering worker)."""
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(
            f"SAGA_NOTIFY_CALLABLE {spec!r} cannot be imported: {exc}"
        ) from exc
    if not callable(target):
        raise ConfigurationError(f"SAGA_NOTIFY_CALLABLE {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


def call(settings: NotifySettings, body: dict[str, Any], notice_id: str, attempt: int) -> str:
    function = resolve(settings.callable)
    try:
        function(body)
    except Exception as exc:
        raise NotificationError(f"{settings.callable} raised {type(exc).__name__}: {exc}") from exc
    return "called"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would re-target (or drop) the signed body: it counts as a failure."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects())


def post(settings: NotifySettings, body: dict[str, Any], notice_id: str, attempt: int) -> str:
    data = encode(body)
    request = urllib.request.Request(
        settings.webhook_url,
        data=data,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "saga-notify/1",
            SIGNATURE_HEADER: sign(data, settings.webhook_secret),
            NOTICE_ID_HEADER: notice_id,
            ATTEMPT_HEADER: str(attempt),
        },
    )
    try:
        with _OPENER.open(request, timeout=settings.timeout) as response:
            return f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        raise NotificationError(f"the webhook answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise NotificationError(f"the webhook did not answer: {exc.reason}") from None
    except OSError as exc:  # a reset connection, a timeout while reading
        raise NotificationError(
            f"the webhook did not answer: {type(exc).__name__}: {exc}"
        ) from None


SINKS: dict[str, Sink] = {CALLABLE: call, WEBHOOK: post}
