"""The ``saga`` command's import discipline: ``--help`` imports click and little else, and the
read-only commands never import Celery, kombu, the hosted loop or the engine, so they start
fast. Checked on ``sys.modules`` after running each command in a fresh interpreter (never a
timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from saga.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Never imported by a command that only reads.
HEAVY = ("celery", "kombu", "billiard", "flower", "prometheus_client", "pydantic", "openai")
OURS_HEAVY = ("saga.engine", "saga.worker", "saga.agents", "saga.notifications.notifier")
#: Not even imported to print the help.
FOR_HELP = (*HEAVY, "sqlalchemy", "redis", "rich", "alembic", "saga.records", "saga.stack")

_RUN = """
import json, sys
from saga.cli import cli
try:
    cli.main(args=sys.argv[1:], prog_name="saga")
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def _modules_after(tmp_path: Path, *args: str, codes: tuple[int | None, ...] = (0, 3)) -> set[str]:
    """Run ``saga ARGS`` in a fresh interpreter (Redis away: the records answer) and return
    the modules it imported."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {
        "SAGA_REDIS_URL": url,
        "SAGA_BROKER_URL": url,
        "SAGA_DATABASE_URL": f"sqlite:///{tmp_path / 'saga.db'}",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] in (*codes, None), done.stdout + done.stderr
    return set(report["modules"])


def _imported(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(f"{n}.") for n in names))


def test_help_imports_neither_the_services_clients_nor_rich(tmp_path: Path) -> None:
    assert _imported(_modules_after(tmp_path, "--help"), FOR_HELP) == []


@pytest.mark.parametrize(
    "args",
    [
        ["runs"],
        ["runs", "--json"],
        ["show", "some-run"],
        ["escalations"],
        ["escalations", "--json"],
        ["escalation", "show", "some-run:0"],
        ["escalation", "show", "some-run:0", "--json"],
    ],
    ids=" ".join,
)
def test_read_only_commands_never_import_celery(tmp_path: Path, args: list[str]) -> None:
    modules = _modules_after(tmp_path, *args)
    assert "sqlalchemy" in modules  # the check can see what the command did import
    assert _imported(modules, HEAVY + OURS_HEAVY) == []


def test_the_check_can_fail(tmp_path: Path) -> None:
    """``requeue`` imports the app, and so Celery: the same check notices."""
    modules = _modules_after(tmp_path, "--app", "json:dumps", "requeue", "r-1", codes=(2,))
    assert "celery" in _imported(modules, HEAVY)
