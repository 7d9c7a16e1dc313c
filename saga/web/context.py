"""What the web app works with: the narrow things (the runs' Redis through ``Client``, the
records, its settings) and, only for requeue and resolve, the application's ``Saga`` (its tool
registry runs the undos), named by ``SAGA_APP``.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from saga.client import Client
from saga.errors import ConfigurationError, NoAppError
from saga.records import RecordStore
from saga.stack import RunStore
from saga.web.settings import WebSettings

# Types only: the engine loads where an app is named (``load_app``), not in every web process.
if TYPE_CHECKING:
    from saga.engine import Saga


@dataclass
class WebContext:
    client: Client
    records: RecordStore
    settings: WebSettings
    _saga: Saga | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def store(self) -> RunStore:
        return self.client.store

    def saga(self) -> Saga:
        """The application's ``Saga``, imported on first use; ``NoAppError`` if none is named
        (the API answers 503 saying so)."""
        with self._lock:
            if self._saga is None:
                if not self.settings.app:
                    raise NoAppError(
                        "requeue and resolve need the application's Saga (its tools run the "
                        "undos): start the server with SAGA_APP=module:attr"
                    )
                self._saga = load_app(self.settings.app)
            return self._saga


def load_app(spec: str) -> Saga:
    """``module:attr`` → the ``Saga`` it names (imported from the current directory too, as
    ``celery -A`` does)."""
    # Imported on use: only a process that serves loads the app.
    from saga.engine import Saga

    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ConfigurationError(f"SAGA_APP={spec!r}: expected module:attr, e.g. tasks.app:saga")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    found: Any = importlib.import_module(module_name)
    for part in (attr or "saga").split("."):
        found = getattr(found, part, None)
    if not isinstance(found, Saga):
        raise ConfigurationError(f"SAGA_APP={spec!r} names no saga.Saga")
    return found
