"""The web surface's settings, read from ``SAGA_API_*`` (and ``SAGA_APP``); every default here.

The stores it reads (``SAGA_REDIS_URL``, ``SAGA_BROKER_URL``, ``SAGA_DATABASE_URL``) are the
workers' own settings (``saga.settings``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Self

from saga.errors import ConfigurationError
from saga.settings import _env_flag, _env_int


def _int(name: str, default: int, low: int, high: int) -> int:
    try:
        value = _env_int(name, default)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if not low <= value <= high:
        raise ConfigurationError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _flag(name: str, default: bool) -> bool:
    try:
        return _env_flag(name, default)
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None


@dataclass(frozen=True)
class WebSettings:
    #: Where ``saga serve`` listens.
    host: str = "127.0.0.1"
    port: int = 8000
    #: Uvicorn worker processes.
    workers: int = 1
    #: The path prefix a proxy serves the app under (``/saga``): links and cookies use it.
    root_path: str = ""
    #: ``module:attr`` of the application's ``Saga``: requeue needs its tools (503 without).
    app: str = ""
    #: Largest request body accepted, in bytes (413 above it).
    max_body_bytes: int = 256 * 1024
    #: How long a console login lasts, in seconds.
    session_seconds: int = 8 * 3600
    #: Send the console's cookies with ``Secure`` (off only behind no TLS at all; browsers
    #: treat http://localhost and 127.0.0.1 as secure, so tests keep it on).
    secure_cookies: bool = True
    #: Console sessions one token may hold at once; a login beyond it ends the oldest.
    sessions_per_token: int = 10
    #: Live run streams one console session may hold open at once (429 beyond it).
    streams_per_session: int = 4

    @classmethod
    def from_env(cls) -> Self:
        root = os.environ.get("SAGA_API_ROOT_PATH", "").strip().rstrip("/")
        if root and not root.startswith("/"):
            raise ConfigurationError(f"SAGA_API_ROOT_PATH must start with '/', got {root!r}")
        return cls(
            host=os.environ.get("SAGA_API_HOST", "").strip() or cls.host,
            port=_int("SAGA_API_PORT", cls.port, 1, 65535),
            workers=_int("SAGA_API_WORKERS", cls.workers, 1, 64),
            root_path=root,
            app=os.environ.get("SAGA_APP", "").strip(),
            max_body_bytes=_int("SAGA_API_MAX_BODY_BYTES", cls.max_body_bytes, 1024, 64 << 20),
            session_seconds=_int("SAGA_API_SESSION_SECONDS", cls.session_seconds, 60, 30 * 86400),
            secure_cookies=_flag("SAGA_API_SECURE_COOKIES", cls.secure_cookies),
            sessions_per_token=_int("SAGA_API_SESSIONS_PER_TOKEN", cls.sessions_per_token, 1, 1000),
            streams_per_session=_int(
                "SAGA_API_STREAMS_PER_SESSION", cls.streams_per_session, 1, 100
            ),
        )
