"""Where escalation notices go, and how hard saga tries: read from ``SAGA_NOTIFY_*``.

Every process that records escalations (workers, the reaper, an agent process that finishes
runs) decides from these settings which sinks get a notice; the worker that delivers it reads
them again for the address, the secret and the retry budget. Give them the same environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Self
from urllib.parse import urlsplit

from saga.errors import ConfigurationError
from saga.retry import RetryPolicy

#: The sink names, as stored with each notice and shown in task ids.
CALLABLE, WEBHOOK = "callable", "webhook"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None


@dataclass(frozen=True)
class NotifySettings:
    #: ``"package.module:attribute"``: a function called with each notice's body (a dict).
    callable: str = ""
    #: Where each notice's body is POSTed as JSON (https, or http to a loopback address).
    webhook_url: str = ""
    #: The HMAC-SHA256 key of the ``Saga-Signature`` header (required with a webhook URL).
    webhook_secret: str = ""
    #: Seconds one POST may take, connecting included (keep it well below the time limit).
    timeout: float = 10.0
    #: Deliveries of one notice to one sink before it is recorded failed.
    attempts: int = 8
    #: Exponential backoff between deliveries (full jitter), first delay and cap, in seconds.
    backoff: float = 2.0
    backoff_max: float = 300.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigurationError("; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when nothing is)."""
        problems = []
        if self.callable and (":" not in self.callable or self.callable.endswith(":")):
            problems.append(
                f"SAGA_NOTIFY_CALLABLE must be 'package.module:function', got {self.callable!r}"
            )
        if self.webhook_url:
            parts = urlsplit(self.webhook_url)
            loopback = parts.scheme == "http" and parts.hostname in _LOOPBACK
            if parts.scheme != "https" and not loopback:
                problems.append(
                    "SAGA_NOTIFY_WEBHOOK_URL must be https:// (http:// only to a loopback "
                    "address): the body holds the run's arguments and results"
                )
            if not self.webhook_secret:
                problems.append("SAGA_NOTIFY_WEBHOOK_URL is set without SAGA_NOTIFY_WEBHOOK_SECRET")
        if self.timeout <= 0:
            problems.append("SAGA_NOTIFY_TIMEOUT must be above 0")
        if self.attempts < 1:
            problems.append("SAGA_NOTIFY_ATTEMPTS must be at least 1")
        if self.backoff < 0 or self.backoff_max < 0:
            problems.append("SAGA_NOTIFY_BACKOFF and SAGA_NOTIFY_BACKOFF_MAX must not be negative")
        return problems

    @property
    def sinks(self) -> tuple[str, ...]:
        """The sinks configured, in the order they are told."""
        return tuple(
            name
            for name, value in ((CALLABLE, self.callable), (WEBHOOK, self.webhook_url))
            if value
        )

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.attempts, backoff=self.backoff, backoff_max=self.backoff_max
        )

    @classmethod
    def from_env(cls) -> Self:
        env = os.environ
        return cls(
            callable=env.get("SAGA_NOTIFY_CALLABLE", "").strip(),
            webhook_url=env.get("SAGA_NOTIFY_WEBHOOK_URL", "").strip(),
            webhook_secret=env.get("SAGA_NOTIFY_WEBHOOK_SECRET", ""),
            timeout=_number("SAGA_NOTIFY_TIMEOUT", cls.timeout),
            attempts=int(_number("SAGA_NOTIFY_ATTEMPTS", cls.attempts)),
            backoff=_number("SAGA_NOTIFY_BACKOFF", cls.backoff),
            backoff_max=_number("SAGA_NOTIFY_BACKOFF_MAX", cls.backoff_max),
        )

    def __repr__(self) -> str:
        """Never the secret, nor the URL's path (a chat webhook's URL is itself a credential)."""
        secret = "***" if self.webhook_secret else ""
        url = urlsplit(self.webhook_url)
        shown = f"{url.scheme}://{url.hostname or ''}/***" if self.webhook_url else ""
        return (
            f"NotifySettings(callable={self.callable!r}, webhook_url={shown!r}, "
            f"webhook_secret={secret!r}, timeout={self.timeout}, attempts={self.attempts})"
        )
