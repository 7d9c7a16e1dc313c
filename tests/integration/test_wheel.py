"""saga as a new user meets it: the wheel, installed in a fresh virtualenv outside the
repository, under an app of one's own (two tools and a compensation, in a module that is not
called ``tasks``), with a real worker started from that virtualenv, against a Redis configured
as compose.yaml configures it (its ACL users, made by its own entrypoint script) and a password
full of ``@:/%#`` read from a file.

The virtualenv gets saga from the wheel alone; the third-party dependencies come from this
environment's site-packages through a ``.pth`` line (no network, no editable saga: a path named
in a ``.pth`` file has its own ``.pth`` files ignored). It checks that the wheel's files are
what is imported and that ``import tasks`` fails there.

Then it compensates a run, escalates two (an undo that fails), and requeues one and resolves
the other with the commands exactly as saga prints them: the worker's log names the
escalation's ``show`` command, the card that command prints names ``requeue``, and the notice
body (what a webhook receives) names ``resolve``. Nothing is added to them by hand.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from saga.records import migrations
from saga.testing import free_port
from tests.conftest import ROOT, service_missing
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

#: Every character a URL gives a meaning to, and a space.
PASSWORD = "p@ss:w/rd%40#frag?x=1 y"
APP = "refunds_app"
PIP = (sys.executable, "-m", "pip")


def _clean_env() -> dict[str, str]:
    """This environment without what points Python or pip at the checkout (the test session
    sets PYTHONPATH to it: pip would then find saga "already installed" there)."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "SAGA_"))
    }


APP_SOURCE = '''
"""A project's own saga app: two tools and a compensation, its own module name."""
import json, os
from pathlib import Path
from celery import Celery
from saga import RetryPolicy, Saga, StepContext, ToolClass, ToolRegistry, Undo

DATA = Path(os.environ["APP_DATA"])
QUICK = RetryPolicy(attempts=2, backoff=0.1, backoff_max=0.2)
tools = ToolRegistry()


def _undo(args, result):
    return Undo("unbook", {"booking": result["booking"]}, f"cancel {result['booking']}")


@tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=_undo, retry=QUICK)
def book(ctx: StepContext, amount: int) -> dict:
    (DATA / f"booked-{ctx.idempotency_key}").write_text(str(amount))
    return {"booking": ctx.idempotency_key}


@tools.compensation(retry=QUICK)
def unbook(ctx: StepContext, booking: str) -> dict:
    if (DATA / "unbook-down").exists():
        raise RuntimeError("the booking system is down")
    (DATA / f"booked-{booking}").unlink(missing_ok=True)
    return {"cancelled": booking}


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=QUICK)
def send(ctx: StepContext, text: str) -> dict:
    raise RuntimeError("the mail service refuses everything")


def on_notice(body: dict) -> None:
    with open(DATA / "notices.jsonl", "a") as out:
        out.write(json.dumps(body) + "\\n")


app = Celery("refunds")
app.config_from_object("saga.celery_defaults")
saga = Saga(app, tools)
'''

DRIVE_SOURCE = '''
"""The project's agent loop, in short: book, then a send that fails; print the outcome."""
import json
from saga import SagaError
from refunds_app import saga

run = saga.start_run()
run.call("book", amount=100).result(timeout=30)
try:
    run.call("send", text="hello").result(timeout=30)
except SagaError:
    pass
print(json.dumps({"run_id": run.run_id, "state": run.wait(timeout=90).state.value}))
'''


#: A project's agents in a module its app does not import (README: `--include myagents`).
AGENTS_SOURCE = """
from saga.agents import ScriptedPolicy
from refunds_app import saga

saga.agent("booker", ScriptedPolicy([[("book", {"amount": 5})], "booked"]))
"""

#: The project's own test, on saga's pytest plugin alone (its worker takes saga_include).
KIT_TEST = """
def test_the_included_agent_books(saga_app, saga_worker):
    run_id = saga_app.enqueue_run("booker", "book 5")
    assert saga_app.run(run_id).wait(timeout=60).state.value == "completed"
"""

KIT_INI = """[pytest]
saga_app = refunds_app:saga
saga_include = myagents
pythonpath = .
addopts = -p no:cacheprovider
"""


@dataclass
class Installed:
    venv: Path
    app_dir: Path
    data: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            list(args),
            env=self.env,
            cwd=self.app_dir,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check:
            assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done

    def printed(self, command: str) -> subprocess.CompletedProcess[str]:
        """A command exactly as saga printed it, run the way a shell would (``saga`` from the
        virtualenv's bin, first on the PATH)."""
        return self.run(*shlex.split(command), check=False)


def compose_redis_args(secrets: Path) -> list[str]:
    """The redis-server arguments compose.yaml's redis service starts with: its entrypoint
    script run as the container would run it (secrets read from ``secrets``), with a stand-in
    for the image's docker-entrypoint.sh that prints what it was handed."""
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    shell, flag, script, name = service["entrypoint"]
    script = script.replace("$$", "$").replace("/run/secrets/", f"{secrets}/")
    fake = secrets / "bin"
    fake.mkdir()
    (fake / "docker-entrypoint.sh").write_text('#!/bin/sh\nprintf "%s\\0" "$@"\n')
    (fake / "docker-entrypoint.sh").chmod(0o755)
    done = subprocess.run(
        [shell, flag, script, name, *service["command"]],
        env={"PATH": f"{fake}:/usr/bin:/bin"},
        capture_output=True,
        check=True,
        timeout=30,
    )
    args = done.stdout.decode().split("\0")[:-1]
    assert args[0] == "redis-server"
    return args[1:]


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A redis-server with compose.yaml's flags and ACL users (its secret files hold
    PASSWORD), stopped by its PID."""
    if shutil.which("redis-server") is None:
        service_missing("redis-server is not installed (Debian: apt-get install redis-server)")
    secrets = tmp_path_factory.mktemp("secrets")
    for user in ("saga", "flower", "readonly"):
        (secrets / f"redis_{user}_password").write_text(PASSWORD + "\n")
    args = compose_redis_args(secrets)
    port = free_port()
    data = tmp_path_factory.mktemp("redis-data")
    process = subprocess.Popen(
        ["redis-server", *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    client = redis.Redis(port=port, username="saga", password=PASSWORD)
    try:
        wait_until(lambda: _pings(client), timeout=15, what="the secured redis-server")
        yield port, secrets
    finally:
        client.close()
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(15)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, secured_redis: tuple[int, Path]
) -> Installed:
    """The wheel, built from this checkout and installed in a virtualenv in a temporary
    directory, beside an app directory of the project's own."""
    port, secrets = secured_redis
    base = tmp_path_factory.mktemp("newcomer")
    dist, source = base / "dist", base / "source"
    # Built from a copy of what the package is made of (setuptools builds in-tree, and the
    # checkout must not get a build/ directory).
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "saga", source / "saga", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        check=True,
        timeout=180,
        capture_output=True,
        env=_clean_env(),
    )
    [wheel] = dist.glob("saga_compensation-*.whl")
    venv = base / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=_clean_env()
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [*PIP, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=120,
        capture_output=True,
        env=_clean_env(),
    )
    # The dependencies (celery, redis, SQLAlchemy, ...) from this environment, after the
    # virtualenv's own site-packages: saga itself is found in the wheel's files first.
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    app_dir, data = base / "project", base / "data"
    app_dir.mkdir()
    data.mkdir()
    (app_dir / f"{APP}.py").write_text(APP_SOURCE)
    (app_dir / "drive.py").write_text(DRIVE_SOURCE)
    url = f"redis://saga@127.0.0.1:{port}"
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(base),
        "APP_DATA": str(data),
        "SAGA_BROKER_URL": f"{url}/0",
        "SAGA_RESULT_BACKEND": f"{url}/1",
        "SAGA_REDIS_URL": f"{url}/2",
        "SAGA_REDIS_PASSWORD_FILE": str(secrets / "redis_saga_password"),
        # No SAGA_DATABASE_URL: the records are where saga puts them by default (a per-user
        # directory, whichever directory a process starts in).
        "XDG_DATA_HOME": str(base / "xdg"),
        "SAGA_NOTIFY_CALLABLE": f"{APP}:on_notice",
        "PYTHONPATH": str(app_dir),
    }
    return Installed(venv, app_dir, data, env)


@pytest.fixture(scope="module")
def worker(installed: Installed) -> Iterator[Path]:
    """``celery -A refunds_app worker`` from the virtualenv; stopped by its process group."""
    log = installed.data / "worker.log"
    # (celery's own script is not in the virtualenv: celery comes with the dependencies)
    python = str(installed.venv / "bin" / "python")
    command = [python, "-m", "celery", "-A", APP, "worker", "-n", "tools@%h"]
    command += ["-Q", "celery,saga.turns", "-c", "2", "--without-gossip", "--without-mingle"]
    command += ["--loglevel", "INFO", "--logfile", str(log)]
    process = subprocess.Popen(
        command,
        env=installed.env,
        cwd=installed.app_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: (log.exists() and " ready." in log.read_text()) or process.poll() is not None,
            timeout=60,
            what="the worker from the wheel",
        )
        assert process.poll() is None, log.read_text()[-3000:]
        yield log
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _drive(installed: Installed) -> dict[str, Any]:
    done = installed.run(str(installed.venv / "bin" / "python"), "drive.py")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _logged_show_command(log: Path, run_id: str) -> str:
    """The ``saga ... escalation show`` command the worker's ERROR line gives for the run."""

    def found() -> str | None:
        match = re.search(rf"`(saga [^`]*escalation show {run_id}:\d+)`", log.read_text())
        return match[1] if match else None

    return wait_until(found, timeout=30, what=f"the escalation of {run_id} in the log")


def _card_commands(card: str) -> dict[str, str]:
    """The Commands section of a card as printed: label → command."""
    section = card.split("\nCommands\n", 1)[1]
    return dict(
        (label, command)
        for label, command in re.findall(
            r"^\s+(requeue|correct|resolve|show)  (saga .*)$", section, re.M
        )
    )


def _notice(installed: Installed, escalation_id: str) -> dict[str, Any]:
    notices = installed.data / "notices.jsonl"

    def found() -> dict[str, Any] | None:
        if not notices.exists():
            return None
        bodies = [json.loads(line) for line in notices.read_text().splitlines()]
        return next((b for b in bodies if b["escalation_id"] == escalation_id), None)

    return wait_until(found, timeout=60, what=f"the notice of {escalation_id}")


def test_the_wheel_is_saga_alone_and_is_what_the_virtualenv_imports(installed: Installed) -> None:
    python = str(installed.venv / "bin" / "python")
    where = installed.run(python, "-c", "import saga, sys; print(saga.__file__)").stdout
    assert where.startswith(str(installed.venv)), where
    assert str(ROOT) not in where
    # the demo app is not in the wheel, so a project's own `tasks` is never shadowed
    missing = installed.run(python, "-c", "import tasks", check=False)
    assert missing.returncode == 1 and "No module named 'tasks'" in missing.stderr
    files = installed.run(
        python, "-c", "import saga.stack, saga.records.migrations as m; print(m.head())"
    )
    # the migrations (and the Lua scripts) shipped inside, up to this checkout's head
    assert files.stdout.strip() == migrations.head()


def test_a_project_of_its_own_compensates_escalates_requeues_and_resolves(
    installed: Installed, worker: Path
) -> None:
    # Given the undo works: a failed send is unwound, the booking cancelled
    started = time.monotonic()
    compensated = _drive(installed)
    assert compensated["state"] == "compensated"
    assert not list(installed.data.glob("booked-*"))

    # Given the booking system is down: the undo gives up, two runs escalate
    (installed.data / "unbook-down").write_text("")
    to_requeue, to_resolve = _drive(installed), _drive(installed)
    assert to_requeue["state"] == to_resolve["state"] == "escalated"

    # When the person follows the worker's log: it names the command that shows the card
    show = _logged_show_command(worker, to_requeue["run_id"])
    assert show.startswith(f"saga --app {APP}:saga escalation show ")  # found, never set
    card = installed.printed(show)
    assert card.returncode == 0, card.stderr
    commands = _card_commands(card.stdout)
    assert commands["requeue"] == f"saga --app {APP}:saga requeue {to_requeue['run_id']}"
    # and shown without --app (nor SAGA_APP), its requeue names the app the workers published
    bare = installed.printed(show.replace(f"--app {APP}:saga ", ""))
    assert bare.returncode == 0, bare.stderr
    assert _card_commands(bare.stdout)["requeue"] == commands["requeue"]

    # When the cause is fixed and the run requeued with the card's command, as printed
    (installed.data / "unbook-down").unlink()
    requeued = installed.printed(commands["requeue"])

    # Then it compensates (exit 0): the booking is cancelled
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    assert "compensated" in requeued.stdout
    assert not (installed.data / f"booked-{to_requeue['run_id']}:1").exists()

    # When the other is resolved with the command its notice (a webhook's body) gives
    notice = _notice(installed, f"{to_resolve['run_id']}:0")
    resolve = notice["commands"]["resolve"]
    assert resolve.startswith(f"saga --app {APP}:saga resolve {to_resolve['run_id']}:0 --note ")
    resolved = installed.printed(resolve)

    # Then it is closed, and no escalation is open any more
    assert resolved.returncode == 0, resolved.stdout + resolved.stderr
    listed = json.loads(installed.run("saga", "escalations", "--json").stdout)
    assert listed["escalations"] == []
    print(f"the runs and commands took {time.monotonic() - started:.1f}s")


def test_saga_runs_shows_the_steps_and_no_footer_without_an_open_escalation(
    installed: Installed, worker: Path
) -> None:
    # Given the project's runs, none with an open escalation (one requeued, one resolved)
    # When they are listed as a person lists them (a wide terminal, no --tool)
    listed = installed.run("saga", "runs", "--since", "2h")
    table = subprocess.run(
        ["saga", "runs"],
        env={**installed.env, "COLUMNS": "200"},
        cwd=installed.app_dir,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout

    # Then each run's steps are shown, and no footer about open escalations
    assert "book, send" in table, table
    assert "open escalation:" not in table
    assert "book" in listed.stdout  # --since 2h: the same parser as the API


def test_every_directory_sees_the_same_records_and_a_new_one_is_said(
    installed: Installed, worker: Path
) -> None:
    # Given the two escalations the worker recorded (started in the project's directory)
    elsewhere = installed.app_dir.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)

    # When they are listed from another directory
    done = subprocess.run(
        ["saga", "escalations", "--all", "--json"],
        env=installed.env,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then the same records are read (the default does not depend on the directory)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["escalations"]) == 2, done.stdout
    assert "did not exist" not in done.stderr
    assert not list(elsewhere.iterdir())  # and nothing was created there
    assert (installed.env["XDG_DATA_HOME"] + "/saga/saga.db") in _default_url(installed)

    # When the records' default location is new (another user's data directory)
    fresh = {**installed.env, "XDG_DATA_HOME": str(elsewhere / "data")}
    listed = subprocess.run(
        ["saga", "escalations"],
        env=fresh,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then the command says which database it created, empty
    assert listed.returncode == 0, listed.stderr
    created = elsewhere / "data" / "saga" / "saga.db"
    assert f"the records database {created} did not exist: created it, empty" in listed.stderr


def test_serve_without_the_api_extra_names_it_and_exits_5(installed: Installed) -> None:
    # Given the virtualenv without FastAPI (a module that fails to import as a missing one)
    shadow = installed.data / "without-api" / "fastapi"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n"
    )
    env = {**installed.env, "PYTHONPATH": f"{shadow.parent}:{installed.app_dir}"}

    # When `saga serve` starts
    done = subprocess.run(
        ["saga", "serve"], env=env, capture_output=True, text=True, timeout=60, check=False
    )

    # Then it exits 5 (an extra is missing, as docs/operations.md says), naming the extra
    assert done.returncode == 5, done.stderr
    assert "pip install 'saga-compensation[api]'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("url", ["localhost:6379", "redis://h:port/0", "redis://h/zero"])
def test_a_malformed_redis_url_is_one_line_and_exit_2(installed: Installed, url: str) -> None:
    done = subprocess.run(
        ["saga", "runs"],
        env={**installed.env, "SAGA_REDIS_URL": url, "SAGA_REDIS_PASSWORD_FILE": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"SAGA_REDIS_URL={url!r}" in done.stderr, done.stderr


def test_the_pytest_plugin_hosts_an_agent_of_an_included_module(installed: Installed) -> None:
    # Given a project whose agent lives in a module the app does not import, and its test
    kit = installed.app_dir.parent / "kit"
    (kit / "tests").mkdir(parents=True, exist_ok=True)
    shutil.copy(installed.app_dir / f"{APP}.py", kit / f"{APP}.py")
    (kit / "myagents.py").write_text(AGENTS_SOURCE)
    (kit / "tests" / "test_agent.py").write_text(KIT_TEST)
    (kit / "pytest.ini").write_text(KIT_INI)
    env = {k: v for k, v in installed.env.items() if not k.startswith(("SAGA_", "PYTHONPATH"))}

    # When its tests run (the kit starts its own Redis and a worker with --include myagents)
    done = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-m", "pytest", "-q"],
        env=env,
        cwd=kit,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

    # Then the worker hosted the agent: its run completed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


def _default_url(installed: Installed) -> str:
    python = str(installed.venv / "bin" / "python")
    code = "from saga.settings import Settings; print(Settings.from_env().database_url)"
    return installed.run(python, "-c", code).stdout


def test_the_readonly_user_reads_and_cannot_write(
    installed: Installed, secured_redis: tuple[int, Path], worker: Path
) -> None:
    """compose.yaml's `readonly` login (the API's): the read-only commands work with it."""
    port, secrets = secured_redis
    reader = {
        **installed.env,
        "SAGA_REDIS_URL": f"redis://readonly@127.0.0.1:{port}/2",
        "SAGA_REDIS_PASSWORD_FILE": str(secrets / "redis_readonly_password"),
    }
    done = subprocess.run(
        ["saga", "runs", "--json"],
        env=reader,
        cwd=installed.app_dir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "Redis does not answer" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["runs"]
    client = redis.Redis(port=port, username="readonly", password=PASSWORD, db=2)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("saga:x", "1")
    client.close()
