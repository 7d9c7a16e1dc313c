"""How the ``saga`` command is invoked for an application: the prefix of every command an
escalation prints (the card, its JSON and Markdown, the webhook's notice).

The commands that act on a run (requeue, resolve) import the application's ``Saga``, so a
printed command must name it: ``saga --app myproject.worker:saga requeue RUN``. The process
that escalates knows its ``Saga`` but not how it was imported, so the spec comes from the
``SAGA_APP`` setting when given, else from the imported module that holds the ``Saga`` as a
global (``celery -A myproject.worker`` imported it, so the command can import it again).
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

#: Modules never named: the one run as a script is not importable under that name.
_NOT_IMPORTABLE = frozenset({"__main__", "__mp_main__"})


def saga_command(app: str = "") -> str:
    """``saga``, with ``--app APP`` when the application is known."""
    return f"saga --app {shlex.quote(app)}" if app else "saga"


def app_spec_of(saga: Any, configured: str = "") -> str:
    """``module:attr`` naming ``saga``: ``configured`` (``SAGA_APP``) when set, else the
    imported module holding it as a global, preferring the Celery app's main module and then
    the shortest name; "" when no module holds it."""
    if configured:
        return configured
    found: list[tuple[str, str]] = []
    for name, loaded in list(sys.modules.items()):
        if name in _NOT_IMPORTABLE or name.startswith("saga.") or loaded is None:
            continue
        try:
            names = vars(loaded)
        except TypeError:
            continue
        for attr, value in list(names.items()):
            if value is saga and not attr.startswith("_"):
                found.append((name, attr))
    if not found:
        return ""
    main = str(getattr(getattr(saga, "app", None), "main", "") or "")
    found.sort(key=lambda f: (f[0] != main, f[0].count("."), len(f[0]), f[1] != "saga", f))
    module, attr = found[0]
    return f"{module}:{attr}"


def command_for(saga: Any) -> str:
    """The ``saga`` command for this ``Saga``'s escalations (its settings' ``app`` first)."""
    settings = getattr(saga, "settings", None)
    return saga_command(app_spec_of(saga, str(getattr(settings, "app", "") or "")))
