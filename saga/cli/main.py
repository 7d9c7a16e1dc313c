"""The ``saga`` command: look at runs and escalations, requeue, resolve, reap, check a
deployment. Every failure maps to an exit code that says what kind it is (``ExitCode``).

Only click is imported here: the command modules import what they use inside their functions,
so ``saga --help`` and the read-only commands start fast (``tests/unit/test_cli_imports.py``).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from saga.cli.context import EXIT_CODES_HELP, Env, ExitCode, Failure
from saga.cli.db import db
from saga.cli.doctor import doctor
from saga.cli.drill import drill
from saga.cli.escalations import escalation, escalations
from saga.cli.indexes import indexes
from saga.cli.operate import reap, requeue, resolve
from saga.cli.reversal import reversal
from saga.cli.runs import runs, show
from saga.cli.serve import serve
from saga.cli.tokens import tokens
from saga.extras import DISTRIBUTION

APP_HELP = (
    "The application's Saga as module:attr (also SAGA_APP), for requeue, resolve and reap; "
    "taken before or after the command. Read-only commands never import it."
)


class _Saga(click.Group):
    """Turns saga's and the services' errors into exit codes (never a traceback for a
    service that is down, an extra not installed or a run that does not exist), and gives
    every command ``--app``."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        _give_app_option(cmd)
        super().add_command(cmd, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            failure = _failure(exc)
            if failure is None:
                raise
            raise failure from exc
        finally:
            if isinstance(ctx.obj, Env):
                ctx.obj.close()


def _take_app(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        ctx.ensure_object(Env).app_spec = value


def _give_app_option(cmd: click.Command) -> None:
    """``--app`` on ``cmd`` (and on every command of a group) as well as on ``saga`` itself:
    ``saga requeue RUN --app m:saga`` works as ``saga --app m:saga requeue RUN`` does."""
    if not any(p.name == "app_spec" for p in cmd.params):
        option = click.Option(
            ["--app", "app_spec"],
            metavar="MODULE:ATTR",
            expose_value=False,
            is_eager=True,
            callback=_take_app,
            help=APP_HELP,
        )
        cmd.params.append(option)
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _give_app_option(sub)


def _failing_over(exc: Exception) -> bool:
    """Whether a Redis error that reached a command is a failover answer (READONLY, ...):
    imported only once redis is, so the commands that never touch Redis do not load it."""
    from saga.redis_errors import unavailable

    return unavailable(exc)


def _failure(exc: Exception) -> Failure | None:
    """The exit code of an error raised by saga or by a service's client; None for a bug.

    The services' exception classes are looked up among the modules already imported: an
    error cannot come from a library nobody imported, and importing one here would cost every
    command its start-up time."""
    # Imported on use: `saga --help` loads none of a command's imports.
    from saga import errors

    if isinstance(exc, ModuleNotFoundError):
        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.extras import missing

        exc = missing(exc) or exc
    if isinstance(exc, errors.MissingExtraError):
        return Failure(str(exc), ExitCode.MISSING_EXTRA)
    if isinstance(exc, errors.UnknownRunError):
        return Failure(str(exc), ExitCode.NOT_FOUND)
    if isinstance(exc, errors.InvalidRunIdError | errors.InvalidTextError):
        return Failure(str(exc), ExitCode.USAGE)
    if isinstance(exc, errors.DatabaseSchemaError):
        return Failure(str(exc), ExitCode.BAD_STATE)
    if isinstance(exc, errors.ConfigurationError):
        return Failure(f"configuration: {exc}", ExitCode.USAGE)
    if isinstance(exc, errors.StoreUnavailableError):
        return Failure(f"Redis: {exc}", ExitCode.UNREACHABLE)
    redis = sys.modules.get("redis")
    if redis is not None and isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return Failure(f"Redis: {exc}", ExitCode.UNREACHABLE)
    if redis is not None and _failing_over(exc):
        return Failure(f"Redis: {exc}", ExitCode.UNREACHABLE)
    kombu = sys.modules.get("kombu.exceptions")
    if kombu is not None and isinstance(exc, kombu.OperationalError):
        return Failure(f"the broker: {exc}", ExitCode.UNREACHABLE)
    sqlalchemy = sys.modules.get("sqlalchemy.exc")
    if sqlalchemy is not None and isinstance(exc, sqlalchemy.DBAPIError):
        connect = isinstance(exc, sqlalchemy.OperationalError | sqlalchemy.InterfaceError)
        message = str(exc).splitlines()[0]
        if exc.connection_invalidated or connect:  # it does not answer (not: it refused)
            return Failure(f"the records database: {message}", ExitCode.UNREACHABLE)
        # It answered and refused the statement (a value too long, a missing table): a bad
        # state to look at, not a traceback.
        return Failure(f"the records database refused it: {message}", ExitCode.BAD_STATE)
    return None


@click.group(cls=_Saga, epilog=EXIT_CODES_HELP)
@click.option("--app", "app_spec", envvar="SAGA_APP", metavar="MODULE:ATTR", help=APP_HELP)
@click.version_option(package_name=DISTRIBUTION)
@click.pass_context
def cli(ctx: click.Context, app_spec: str | None) -> None:
    """Look at saga runs and escalations, and deal with them.

    Reads SAGA_REDIS_URL (the stacks), SAGA_BROKER_URL and SAGA_DATABASE_URL (the records),
    like the workers do.
    """
    ctx.obj = Env(app_spec=app_spec or None)


cli.add_command(runs)
cli.add_command(show)
cli.add_command(escalations)
cli.add_command(escalation)
cli.add_command(requeue)
cli.add_command(resolve)
cli.add_command(reap)
cli.add_command(reversal)
cli.add_command(doctor)
cli.add_command(db)
cli.add_command(indexes)
cli.add_command(tokens)
cli.add_command(serve)
cli.add_command(drill)


def main() -> None:
    """The ``saga`` console script (``python -m saga.cli`` too)."""
    cli.main(prog_name="saga")
