"""What every command shares: exit codes, how the app and the stores are found, output.

Read-only commands need nothing but the URLs (``SAGA_REDIS_URL``, ``SAGA_DATABASE_URL``): they
never import the application. Commands that act on runs (requeue, resolve, reap) need its
``Saga``, for the tool registry: ``--app module:attr`` (on the group or on the command) or
``SAGA_APP``. There is no default: a guessed app is someone else's.

This module, and every command module at import, stays light (click and the standard library):
``saga --help`` and the read-only commands import Redis, SQLAlchemy and rich only when they use
them, and never Celery.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

# Types only: a command imports these on use (``saga --help`` loads none of them).
if TYPE_CHECKING:
    from rich.console import Console

    from saga.engine import Saga
    from saga.records import RecordStore
    from saga.settings import Settings
    from saga.stack import RunStore

#: How ``--app`` is written (shown in the errors).
APP_EXAMPLE = "myproject.worker:saga"


class ExitCode(IntEnum):
    """What the ``saga`` command's exit status means (scripts may rely on these)."""

    OK = 0
    #: The thing asked for is in a bad state: doctor found a problem, a requeue escalated again,
    #: nothing to requeue, already resolved.
    BAD_STATE = 1
    #: Bad usage or input (click's own usage errors use 2 as well).
    USAGE = 2
    NOT_FOUND = 3
    #: Redis, the broker or the records database did not answer.
    UNREACHABLE = 4
    #: An optional dependency the command needs is not installed (the message names the
    #: extra: ``pip install 'saga-compensation[postgres]'``).
    MISSING_EXTRA = 5


EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 the thing asked for is in a bad state (doctor found a problem, a "
    "requeue escalated again, nothing to requeue, already resolved); 2 bad usage or input; "
    "3 not found; 4 a service (Redis, broker, database) unreachable; 5 an optional "
    "dependency missing (the message names the extra to install)."
)


class Failure(click.ClickException):
    """A command's failure, with the exit code that says what kind it is."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        # click declares exit_code on the class; each failure carries its own.
        self.exit_code = int(code)  # type: ignore[misc]


def mask(url: str) -> str:
    """A URL fit to print: its password replaced (whatever it holds: '/', ':', '@')."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.settings import masked

    return masked(url)


@dataclass
class Env:
    """The deployment the command talks to, opened lazily (a read-only command never imports
    the application, and never connects to what it does not read)."""

    app_spec: str | None
    _console: Console | None = None
    _saga: Saga | None = None
    _settings: Settings | None = None
    _store: RunStore | None = None
    _records: RecordStore | None = None
    _opened: list[Any] = field(default_factory=list)

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = make_console()
        return self._console

    @property
    def settings(self) -> Settings:
        if self._saga is not None:
            return self._saga.settings
        if self._settings is None:
            # Imported on use: `saga --help` loads none of a command's imports.
            from saga.settings import Settings

            self._settings = Settings.from_env()
        return self._settings

    def saga(self) -> Saga:
        """The application's ``Saga``; exit 2 when none is named or it cannot be loaded."""
        if self._saga is None:
            if not self.app_spec:
                raise Failure(
                    "this command needs the application's Saga: name it with --app "
                    f"module:attr (e.g. --app {APP_EXAMPLE}) or SAGA_APP",
                    ExitCode.USAGE,
                )
            self._saga = load_saga(self.app_spec)
        return self._saga

    def saga_if_any(self) -> Saga | None:
        """The ``Saga`` if one is named (one named that fails to load still exits 2)."""
        return self.saga() if self.app_spec else None

    @property
    def store(self) -> RunStore:
        if self._saga is not None:
            return self._saga.store
        if self._store is None:
            # Imported on use: `saga --help` loads none of a command's imports.
            from saga.stack import RunStore

            self._store = RunStore.for_settings(self.settings)
            self._opened.append(self._store.client)
        return self._store

    def store_if_reachable(self) -> RunStore | None:
        """The stack's Redis, or None (said on stderr) when it does not answer: what the
        records hold can still be shown."""
        # Imported on use: `saga --help` loads none of a command's imports.
        import redis

        try:
            self.store.client.ping()
        except redis.RedisError as exc:
            click.echo(
                f"saga: Redis does not answer ({exc}): showing the records only "
                "(what is live in Redis is not shown)",
                err=True,
            )
            return None
        return self.store

    @property
    def records(self) -> RecordStore:
        if self._records is None:
            settings = self.settings
            fresh = _missing_sqlite_file(settings.database_url)
            if self._saga is not None:
                self._records = self._saga.records
            else:
                # Imported on use: `saga --help` loads none of a command's imports.
                from saga.records import RecordStore

                self._records = RecordStore(
                    settings.database_url, upgrade=settings.database_auto_upgrade
                )
                self._opened.append(self._records)
            if fresh is not None:
                # Never silently: an empty answer from a database nobody writes to would read
                # as "nothing escalated" while the workers record elsewhere.
                click.echo(
                    f"saga: the records database {fresh} did not exist: created it, empty. "
                    "If the workers record elsewhere, set SAGA_DATABASE_URL to theirs.",
                    err=True,
                )
        return self._records

    def command(self, store: RunStore | None = None) -> str:
        """How to invoke ``saga`` again here: with the app this one was given, else (when
        ``store`` is given) the one the workers published, so that a printed ``requeue``,
        which imports the app, works as printed."""
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.escalations.invocation import saga_command

        spec = self.app_spec or ""
        if not spec and store is not None:
            # Imported on use: `saga --help` loads none of a command's imports.
            from saga.tool_hosts import worker_app

            try:
                spec = worker_app(store.client)
            except Exception:  # the commands are printed still, without it
                spec = ""
        return saga_command(spec)

    def close(self) -> None:
        for thing in self._opened:
            closer = getattr(thing, "dispose", None) or getattr(thing, "close", None)
            if closer is not None:
                closer()


def _missing_sqlite_file(url: str) -> Path | None:
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.settings import sqlite_file

    path = sqlite_file(url)
    return path.resolve() if path is not None and not path.exists() else None


def load_saga(spec: str) -> Saga:
    """``module:attr`` (``attr`` defaults to ``saga``) → the ``Saga`` it names. Imported from
    the current directory too, as ``celery -A`` does."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.engine import Saga

    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise Failure(f"--app {spec!r}: expected module:attr, e.g. {APP_EXAMPLE}", ExitCode.USAGE)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.extras import extra_for

        if exc.name is not None and extra_for(exc.name) is not None:
            raise  # the app needs an optional dependency: exit 5, naming it
        raise Failure(f"cannot import the app {spec}: {exc}", ExitCode.USAGE) from exc
    found: Any = module
    for part in (attr or "saga").split("."):
        if not hasattr(found, part):
            raise Failure(f"{module_name} has no {attr or 'saga'} (--app {spec})", ExitCode.USAGE)
        found = getattr(found, part)
    if not isinstance(found, Saga):
        kind = type(found).__name__
        raise Failure(f"--app {spec} is a {kind}, not a saga.Saga", ExitCode.USAGE)
    return found


# -- input -----------------------------------------------------------------------------------


def parse_since(
    ctx: click.Context | None, param: click.Parameter | None, value: str | None
) -> float | None:
    """``--since``: as the API takes it (``saga.listing.parse_since``)."""
    if value is None:
        return None
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.listing import parse_since as parse

    try:
        return parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def parse_escalation_id(ctx: click.Context | None, param: Any, value: str) -> str:
    """An escalation ``ID`` argument, read as the API reads it (``saga.validation``)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga.errors import InvalidRunIdError
    from saga.validation import check_escalation_id

    try:
        return check_escalation_id(value)
    except InvalidRunIdError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def parse_assignment(text: str) -> tuple[int, str, Any]:
    """``STEP.ARG=VALUE`` → (step, argument, value); the value is JSON when it parses as JSON
    (``100``, ``true``, ``"x"``, ``{"a": 1}``), else the text as it is."""
    target, equals, raw = text.partition("=")
    step, dot, arg = target.partition(".")
    # [0-9] only: isdigit() also takes '²' or '٣', which int() refuses.
    number = step.strip()
    digits = bool(number) and all("0" <= c <= "9" for c in number)
    if not equals or not dot or not digits or not arg.strip().isidentifier():
        raise click.BadParameter(
            f"{text!r}: expected STEP.ARG=VALUE (an undo's step number and argument name), "
            "e.g. 3.status=open"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return int(number), arg.strip(), value


def corrections_from(assignments: list[str]) -> dict[int, dict[str, Any]]:
    corrections: dict[int, dict[str, Any]] = {}
    for text in assignments:
        step, arg, value = parse_assignment(text)
        corrections.setdefault(step, {})[arg] = value
    return corrections


# -- output ----------------------------------------------------------------------------------


def make_console() -> Console:
    """Colour on a terminal; piped, plain text 120 columns wide (tables fit, nothing wraps)."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(highlight=False)
    return Console(highlight=False, width=int(os.environ.get("COLUMNS") or 120))


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


def when(timestamp: float | None) -> str:
    """A time for a table: UTC, to the second."""
    if timestamp is None:
        return ""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def bad_state(message: str) -> NoReturn:
    raise Failure(message, ExitCode.BAD_STATE)


def not_found(message: str) -> NoReturn:
    raise Failure(message, ExitCode.NOT_FOUND)
