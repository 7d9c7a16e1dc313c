"""The ``saga`` command: look at runs and escalations, requeue, resolve, reap, check a
deployment. Every failure maps to an exit code that says what kind it is (``ExitCode``)."""

from __future__ import annotations

from typing import Any

import click
import redis
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy.exc import DBAPIError

from saga.cli.context import EXIT_CODES_HELP, Env, ExitCode, Failure, make_console
from saga.cli.db import db
from saga.cli.doctor import doctor
from saga.cli.escalations import escalation, escalations
from saga.cli.operate import reap, requeue, resolve
from saga.cli.runs import runs, show
from saga.cli.serve import serve
from saga.cli.tokens import tokens
from saga.errors import (
    ConfigurationError,
    DatabaseSchemaError,
    InvalidRunIdError,
    StoreUnavailableError,
    UnknownRunError,
)


class _Saga(click.Group):
    """Turns saga's and the services' errors into exit codes (never a traceback for a
    service that is down or a run that does not exist)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UnknownRunError as exc:
            raise Failure(str(exc), ExitCode.NOT_FOUND) from exc
        except InvalidRunIdError as exc:
            raise Failure(str(exc), ExitCode.USAGE) from exc
        except DatabaseSchemaError as exc:
            raise Failure(str(exc), ExitCode.BAD_STATE) from exc
        except (StoreUnavailableError, ConfigurationError, redis.ConnectionError) as exc:
            raise Failure(f"Redis: {exc}", ExitCode.UNREACHABLE) from exc
        except redis.TimeoutError as exc:
            raise Failure(f"Redis: {exc}", ExitCode.UNREACHABLE) from exc
        except BrokerError as exc:
            raise Failure(f"the broker: {exc}", ExitCode.UNREACHABLE) from exc
        except DBAPIError as exc:
            if not exc.connection_invalidated and not _connect_error(exc):
                raise
            message = str(exc).splitlines()[0]
            raise Failure(f"the records database: {message}", ExitCode.UNREACHABLE) from exc
        finally:
            if isinstance(ctx.obj, Env):
                ctx.obj.close()


def _connect_error(exc: DBAPIError) -> bool:
    """A database that does not answer (not one that refused a statement)."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


@click.group(cls=_Saga, epilog=EXIT_CODES_HELP)
@click.option(
    "--app",
    "app_spec",
    envvar="SAGA_APP",
    metavar="MODULE:ATTR",
    help="The application's Saga, for requeue and reap (default: tasks.app:saga when "
    "importable). Read-only commands need only SAGA_REDIS_URL and SAGA_DATABASE_URL.",
)
@click.version_option(package_name="saga")
@click.pass_context
def cli(ctx: click.Context, app_spec: str | None) -> None:
    """Look at saga runs and escalations, and deal with them.

    Reads SAGA_REDIS_URL (the stacks), SAGA_BROKER_URL and SAGA_DATABASE_URL (the records),
    like the workers do.
    """
    ctx.obj = Env(app_spec=app_spec, console=make_console())


cli.add_command(runs)
cli.add_command(show)
cli.add_command(escalations)
cli.add_command(escalation)
cli.add_command(requeue)
cli.add_command(resolve)
cli.add_command(reap)
cli.add_command(doctor)
cli.add_command(db)
cli.add_command(tokens)
cli.add_command(serve)


def main() -> None:
    """The ``saga`` console script (``python -m saga.cli`` too)."""
    cli.main(prog_name="saga")
