"""The two sinks: a Python callable, and a signed JSON POST to a webhook.

Each returns a short description of what it got (``HTTP 204``) or raises ``NotificationError``
(retried by the task, then recorded). Neither ever puts the webhook's URL or secret in an
error: a chat webhook's URL is itself a credential.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from saga.errors import ConfigurationError, NotificationError
from saga.notifications.signing import NOTICE_ID_HEADER, SIGNATURE_HEADER, sign
from saga.notify_settings import CALLABLE, WEBHOOK, NotifySettings

ATTEMPT_HEADER = "Saga-Delivery-Attempt"
#: How much of a webhook's answer is read (it is not used; reading it ends the exchange).
_MOST_READ = 64 * 1024
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


class _Deadline:
    """Cuts one POST's connections once its whole time is up. urllib's ``timeout`` bounds each
    socket operation, not the request: a receiver dripping a byte every few seconds would
    hold the POST past the notice's lease, and the sweep would post it again meanwhile."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.passed = False
        self._connections: list[http.client.HTTPConnection] = []
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def connection(self, base: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            made = base(*args, **kwargs)
            self._connections.append(made)
            return made

        return make

    def opener(self) -> urllib.request.OpenerDirector:
        deadline = self

        class Http(urllib.request.HTTPHandler):
            def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
                return super().do_open(deadline.connection(http_class), req, **kwargs)

        class Https(urllib.request.HTTPSHandler):
            def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
                return super().do_open(deadline.connection(http_class), req, **kwargs)

        return urllib.request.build_opener(_NoRedirects(), Http(), Https())

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def _cut(self) -> None:
        self.passed = True
        for connection in self._connections:
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


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
    with _Deadline(settings.timeout) as deadline:
        try:
            with deadline.opener().open(request, timeout=settings.timeout) as response:
                response.read(_MOST_READ)  # its answer, within the deadline too
                return f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            raise NotificationError(f"the webhook answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            if deadline.passed:
                raise NotificationError(
                    f"the webhook did not answer within {settings.timeout:g}s"
                ) from None
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise NotificationError(
                f"the webhook did not answer: {type(reason).__name__}: {reason}"
            ) from None


SINKS: dict[str, Sink] = {CALLABLE: call, WEBHOOK: post}
