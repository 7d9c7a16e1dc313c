"""Flower for saga, locked down: ``python -m saga.integrations.flower -A tasks.app --port=5555``
(or, without ``-A``, the module of ``SAGA_APP``).

Flower can revoke and terminate tasks, restart pools and send tasks of any name with any
arguments: a revoked compensation is an undo that never runs, a hand-sent ``tools.*`` message a
step outside any rule. So this launcher starts Flower with:

- **authentication required**: HTTP basic auth from ``SAGA_FLOWER_BASIC_AUTH``
  (``user:password``, several separated by commas; never on the command line, where ``ps``
  shows it). Without it Flower does not start, unless ``SAGA_FLOWER_INSECURE_LOCAL=1`` (local
  development), which binds it to 127.0.0.1 only.
- **no control**: every ``/api/`` route except the read-only ones (``READ_ONLY_API``) answers
  403, whatever Flower's version adds; ``--read_only`` is set too where Flower has it.
- Flower's own ``/metrics`` behind the same authentication (``/healthcheck`` stays open).
- **its configuration file screened**: ``flowerconfig.py`` (or ``--conf``) may only assign
  other settings; one that touches authentication refuses the start.

Everything else on the command line goes to Flower (``--port=5555``, ``--url_prefix=flower``:
tornado's ``--name=value`` form).
"""

from __future__ import annotations

import ast
import ipaddress
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from saga.errors import ConfigurationError

BASIC_AUTH_ENV = "SAGA_FLOWER_BASIC_AUTH"
INSECURE_LOCAL_ENV = "SAGA_FLOWER_INSECURE_LOCAL"
LOCAL_ADDRESS = "127.0.0.1"
#: Exit status when it refuses to start (EX_CONFIG, as the worker's guard).
REFUSED = 78
#: Exit status when Flower is not installed (the ``saga`` command's ``ExitCode.MISSING_EXTRA``).
MISSING_EXTRA = 5
#: Flower's API handlers that only read; every other ``/api/`` route is refused.
READ_ONLY_API = frozenset(
    {"ListWorkers", "ListTasks", "ListTaskTypes", "GetQueueLengths", "TaskInfo", "TaskResult"}
)
#: Settings only the environment may give (or that would open the API without a password).
_FORBIDDEN_FLAGS = frozenset({"basic_auth", "unauthenticated_api"})
#: Celery's options that go before the ``flower`` subcommand.
_CELERY_OPTIONS = frozenset({"-A", "--app", "-b", "--broker", "--result-backend", "--config"})


def _name(arg: str) -> str:
    return arg.lstrip("-").partition("=")[0].replace("-", "_")


def _loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def plan(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``celery ... flower ...`` command line and the ``FLOWER_*`` variables to start it
    with; raises ``ConfigurationError`` saying why it must not start."""
    celery_args: list[str] = []
    flower_args: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        option = arg.partition("=")[0]
        if option in _CELERY_OPTIONS:
            celery_args.append(arg)
            if "=" not in arg and args:
                celery_args.append(args.pop(0))
        else:
            flower_args.append(arg)
    if not any(a.partition("=")[0] in ("-A", "--app") for a in celery_args):
        app = env.get("SAGA_APP", "").strip()
        if not app:
            raise ConfigurationError("name the Celery app: -A myproject.worker, or SAGA_APP")
        celery_args[:0] = ["-A", app.partition(":")[0]]  # module:attr names the Saga
    screen_config(flower_args, os.getcwd())
    for arg in flower_args:
        if _name(arg) in _FORBIDDEN_FLAGS:
            raise ConfigurationError(
                f"{arg.partition('=')[0]} is not taken on the command line: "
                f"set {BASIC_AUTH_ENV}=user:password in the environment"
            )
    credentials = env.get(BASIC_AUTH_ENV, "").strip()
    flower_env: dict[str, str] = {}
    if credentials:
        for pair in credentials.split(","):
            user, colon, password = pair.partition(":")
            if not user or not colon or not password:
                raise ConfigurationError(
                    f"{BASIC_AUTH_ENV} must be user:password[,user:password...]"
                )
        flower_env["FLOWER_BASIC_AUTH"] = credentials
    elif env.get(INSECURE_LOCAL_ENV) == "1":
        for arg in flower_args:
            address = arg.partition("=")[2]
            if _name(arg) == "address" and not _loopback(address):
                raise ConfigurationError(
                    f"without {BASIC_AUTH_ENV}, Flower listens on {LOCAL_ADDRESS} only, "
                    f"not {address!r}"
                )
        if not any(_name(a) == "address" for a in flower_args):
            flower_args.append(f"--address={LOCAL_ADDRESS}")
    else:
        raise ConfigurationError(
            f"Flower shows every task's arguments: set {BASIC_AUTH_ENV}=user:password, or "
            f"{INSECURE_LOCAL_ENV}=1 on a development machine (then it listens on "
            f"{LOCAL_ADDRESS} only)"
        )
    return ["celery", *celery_args, "flower", *flower_args], flower_env


def guard_routes(handlers: Sequence[Any]) -> list[Any]:
    """Flower's routes with every non-read-only ``/api/`` handler replaced by a refusal and its
    ``/metrics`` behind authentication."""
    # An optional extra: imported where it is used.
    import tornado.web
    from flower.api import BaseApiHandler
    from flower.views.monitor import Metrics
    from tornado.routing import URLSpec

    class Refused(BaseApiHandler):  # type: ignore[misc]
        """A control action: 401 without credentials, else 403."""

        def check_xsrf_cookie(self) -> None:
            return None  # refused below whatever the token, after the credentials are checked

        def prepare(self) -> None:
            if not self.current_user:
                raise tornado.web.HTTPError(401)
            raise tornado.web.HTTPError(403, "control actions are disabled in saga's Flower")

    class AuthenticatedMetrics(Metrics):  # type: ignore[misc]
        @tornado.web.authenticated
        async def get(self) -> None:
            await super().get()

    def guarded_class(pattern: str, cls: Any) -> Any:
        if pattern.startswith("/api/") and cls.__name__ not in READ_ONLY_API:
            return Refused
        return AuthenticatedMetrics if cls is Metrics else cls

    guarded: list[Any] = []
    for handler in handlers:
        if isinstance(handler, URLSpec):  # declared with url(...): its pattern is a regex
            cls = guarded_class(handler.regex.pattern.lstrip("^"), handler.handler_class)
            if cls is not handler.handler_class:
                handler = URLSpec(handler.regex.pattern, cls, handler.kwargs, handler.name)
            guarded.append(handler)
            continue
        pattern, cls = handler[0], handler[1]
        replaced = guarded_class(pattern, cls)
        guarded.append(handler if replaced is cls else (pattern, replaced, *handler[2:]))
    return guarded


#: Flower reads this file from the working directory (or ``--conf``) after the environment.
DEFAULT_CONFIG = "flowerconfig.py"


def screen_config(flower_args: Sequence[str], cwd: str) -> None:
    """Flower executes its configuration file after reading the environment, so a
    ``flowerconfig.py`` could take the password off (``basic_auth = []``) or open the API
    (``unauthenticated_api = True``). Only plain assignments of other settings are let
    through; anything else in it refuses the start, saying what."""
    given = [a.partition("=")[2] for a in flower_args if _name(a) == "conf"]
    path = os.path.join(cwd, given[-1] if given else DEFAULT_CONFIG)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as file:
        try:
            tree = ast.parse(file.read(), path)
        except SyntaxError as exc:
            raise ConfigurationError(f"{path} is not valid Python: {exc}") from None
    for statement in tree.body:
        names = _assigned(statement)
        if names is None:
            raise ConfigurationError(
                f"{path} line {statement.lineno}: only plain 'name = value' settings are "
                "accepted in Flower's configuration file (it is executed)"
            )
        forbidden = sorted(n for n in names if n in _FORBIDDEN_FLAGS | _FORBIDDEN_IN_CONFIG)
        if forbidden:
            raise ConfigurationError(
                f"{path} sets {', '.join(forbidden)}: set {BASIC_AUTH_ENV}=user:password in "
                "the environment instead"
            )


#: Authentication Flower would take from its configuration file instead of basic auth.
_FORBIDDEN_IN_CONFIG = frozenset({"auth", "auth_provider", "oauth2_key", "oauth2_secret"})


def _assigned(statement: ast.stmt) -> list[str] | None:
    """The names a plain assignment sets (None for any other statement)."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
        return []  # a docstring
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = list(statement.targets)
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        targets = [statement.target]
    if not targets or not all(isinstance(t, ast.Name) for t in targets):
        return None
    return [t.id for t in targets if isinstance(t, ast.Name)]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        celery_argv, flower_env = plan(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigurationError as exc:
        print(f"saga: refusing to start Flower: {exc}", file=sys.stderr)
        return REFUSED
    for name in ("FLOWER_BASIC_AUTH", "FLOWER_UNAUTHENTICATED_API"):
        os.environ.pop(name, None)
    os.environ.update(flower_env)

    try:
        # An optional extra: imported where it is used.
        import flower.urls
        from flower.options import default_options
    except ModuleNotFoundError as exc:
        from saga.extras import missing

        error = missing(exc, "(Flower)")
        if error is None:
            raise
        print(f"saga: refusing to start Flower: {error}", file=sys.stderr)
        return MISSING_EXTRA

    if "read_only" in default_options:
        celery_argv.append("--read_only=True")
    # In place: flower.app imported this very list as its default handlers.
    flower.urls.handlers[:] = guard_routes(flower.urls.handlers)

    # An optional extra: imported where it is used.
    from celery.bin.celery import main as celery_main

    sys.argv = celery_argv
    return int(celery_main())


if __name__ == "__main__":
    sys.exit(main())
