"""saga over HTTP: a JSON API for web apps in any language and an operator console, in one
FastAPI app (``pip install 'saga-compensation[api]'``, served by ``saga serve``, or mounted in
your own ASGI app: ``app.mount("/saga", create_app())``). ``docs/api.md``.

Routes render; they never decide: ``actions`` calls what the ``saga`` command calls.
``tokens`` (the bearer tokens, hashed in the records) needs no FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# For type checkers: ``create_app`` is exported lazily: FastAPI loads where the app is built.
if TYPE_CHECKING:
    from saga.web.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":  # FastAPI is imported only by those who build the app
        # Imported on use: only a process that serves loads the app.
        from saga.web.app import create_app

        return create_app
    raise AttributeError(name)
