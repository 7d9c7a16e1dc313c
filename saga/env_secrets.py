"""Secrets read from the environment: ``NAME``, or the file ``NAME_FILE`` names (a container's
secret), so a password never has to sit in a URL or a compose file's environment."""

from __future__ import annotations

import os
from pathlib import Path

from saga.errors import ConfigurationError


def secret_from_env(name: str) -> str | None:
    """``NAME``, or the content of the file ``NAME_FILE`` names (a container's secret, its
    trailing newline dropped); None when neither is set."""
    value = os.environ.get(name)
    path = os.environ.get(f"{name}_FILE")
    if value and path:
        raise ConfigurationError(f"set {name} or {name}_FILE, not both")
    if path:
        try:
            return Path(path).read_text().rstrip("\n")
        except OSError as exc:
            raise ConfigurationError(f"{name}_FILE: cannot read {path}: {exc}") from None
    return value or None
