"""The optional dependencies (``pip install 'saga-compensation[EXTRA]'``): which extra brings
which module, so that a missing one is named in one line instead of a traceback.
"""

from __future__ import annotations

import importlib.util

from saga.errors import MissingExtraError

#: The distribution's name on the package index (``saga`` there is another project); the import
#: name and the command stay ``saga``.
DISTRIBUTION = "saga-compensation"

#: Top-level module → the extra that installs it.
EXTRAS = {
    "psycopg": "postgres",
    "psycopg2": "postgres",
    "flower": "flower",
    "tornado": "flower",
    "prometheus_client": "metrics",
    "openai": "openai",
    "anthropic": "anthropic",
    "pydantic_ai": "pydantic-ai",
    "agents": "openai-agents",
    "flask": "examples",
    "fastapi": "api",
    "starlette": "api",
    "uvicorn": "api",
    "jinja2": "api",
    "multipart": "api",
    "httpx": "testing",
}


def extra_for(module: str) -> str | None:
    """The extra that installs ``module`` (a dotted name too), or None."""
    return EXTRAS.get(module.partition(".")[0])


def install_hint(extra: str) -> str:
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def missing(error: ModuleNotFoundError, needed_for: str = "") -> MissingExtraError | None:
    """The ``MissingExtraError`` that explains ``error``, or None when no extra brings the
    module (a bug or a broken install, which keeps its traceback)."""
    name = error.name or ""
    extra = extra_for(name)
    if extra is None:
        return None
    purpose = f" {needed_for}" if needed_for else ""
    return MissingExtraError(
        f"{name} is not installed{purpose}: {install_hint(extra)}", extra=extra, module=name
    )


def require(module: str, needed_for: str) -> None:
    """Raise ``MissingExtraError`` unless ``module`` can be imported (without importing it)."""
    if importlib.util.find_spec(module) is None:
        error = missing(ModuleNotFoundError(f"No module named {module!r}", name=module), needed_for)
        raise error or MissingExtraError(f"{module} is not installed ({needed_for})")
