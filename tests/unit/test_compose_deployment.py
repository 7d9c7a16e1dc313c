"""compose.yaml as a whole deployment, checked against the project's own names: the settings
it passes are ones saga reads, the extras it installs exist, the commands are the project's
(the migrations, the metrics option, the locked-down Flower), and no secret is written in it."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from saga.integrations.flower import BASIC_AUTH_ENV
from saga.worker import METRICS_PORT_OPTION

ROOT = Path(__file__).resolve().parents[2]
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
WORKERS = ("worker", "turns")
#: ``${NAME:?message}``: compose refuses to start while it is unset.
REQUIRED = re.compile(r"^\$\{[A-Z_]+:\?[^}]*\}$")


def _command(name: str) -> str:
    command = SERVICES[name]["command"]
    return command if isinstance(command, str) else " ".join(command)


def _saga_source() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "saga").rglob("*.py"))


def test_the_whole_deployment_is_there_and_every_long_running_service_has_a_healthcheck() -> None:
    assert set(SERVICES) == {"redis", "postgres", "migrate", "worker", "turns", "beat", "flower"}
    for name in set(SERVICES) - {"migrate"}:
        assert "test" in SERVICES[name]["healthcheck"], name


def test_the_migrations_run_once_before_anything_writes_to_the_database() -> None:
    assert _command("migrate").endswith('&& saga db upgrade"')
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["migrate"]["environment"]["SAGA_DATABASE_URL"].startswith("postgresql+")
    for name in WORKERS:
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_every_saga_setting_it_passes_is_one_saga_reads() -> None:
    source = _saga_source()
    for name, service in SERVICES.items():
        for variable in service.get("environment", {}):
            if variable.startswith("SAGA_"):
                assert f'"{variable}"' in source, f"{name}: {variable} is read nowhere"


def test_no_secret_is_written_in_the_file() -> None:
    secret = re.compile(r"PASSWORD|SECRET|BASIC_AUTH")
    for name, service in SERVICES.items():
        for variable, value in service.get("environment", {}).items():
            if secret.search(variable):
                assert str(value).startswith("${"), f"{name}: {variable} is written in the file"
        url = service.get("environment", {}).get("SAGA_DATABASE_URL", "")
        if url:
            password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
            assert REQUIRED.match(password), f"{name}: the database password is in the file"
    assert REQUIRED.match(SERVICES["postgres"]["environment"]["POSTGRES_PASSWORD"])


def test_flower_is_the_locked_down_launcher_with_its_password_required() -> None:
    command = _command("flower")
    assert "python -m saga.integrations.flower -A tasks.app" in command
    assert importlib.util.find_spec("saga.integrations.flower") is not None
    assert "basic" not in command and "celery -A tasks.app flower" not in command
    assert REQUIRED.match(SERVICES["flower"]["environment"][BASIC_AUTH_ENV])
    assert all(p.startswith("127.0.0.1:") for p in SERVICES["flower"]["ports"])
    # Flower needs neither the database nor the webhook's secret
    assert not {"SAGA_DATABASE_URL", "SAGA_NOTIFY_WEBHOOK_SECRET"} & set(
        SERVICES["flower"]["environment"]
    )


def test_the_workers_serve_metrics_with_the_extras_that_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name in WORKERS:
        command = _command(name)
        assert f"{METRICS_PORT_OPTION}=9808" in command
        assert "9808" in SERVICES[name]["expose"]
        assert SERVICES[name]["environment"]["SAGA_METRICS_ADDR"] == "0.0.0.0"
    for name in SERVICES:
        if "command" not in SERVICES[name]:
            continue
        for installed in re.findall(r"pip install -e '?\.\[([a-z,]+)\]", _command(name)):
            assert set(installed.split(",")) <= set(extras), name


def test_beat_keeps_its_schedule_where_its_healthcheck_looks() -> None:
    assert "--schedule=/tmp/celerybeat-schedule" in _command("beat")
    assert "celerybeat-schedule" in " ".join(SERVICES["beat"]["healthcheck"]["test"])
