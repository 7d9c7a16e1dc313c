"""compose.yaml as a whole deployment, checked against the project's own names: the settings
it passes are ones saga reads, the commands are the project's (the migrations, the metrics
option, the locked-down Flower, the API), every service runs the image with nothing installed
at start, restarts, has a healthcheck with a short start period, gets its credentials from
secret files (no password in the file or in a URL), and names the app once (SAGA_APP)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from saga.integrations.flower import BASIC_AUTH_ENV
from saga.worker import METRICS_PORT_OPTION

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
WORKERS = ("worker", "turns")
#: The services that run saga's image (the others are Redis and PostgreSQL).
OURS = ("migrate", "worker", "turns", "beat", "flower", "api")
#: ``${NAME:?message}``: compose refuses to start while it is unset.
REQUIRED = re.compile(r"^\$\{[A-Z_]+:\?[^}]*\}$")
#: How the app's module reaches celery -A: SAGA_APP without its ``:attr``, at run time.
APP_MODULE = '"$${SAGA_APP%%:*}"'


def _command(name: str) -> str:
    command = SERVICES[name]["command"]
    return command if isinstance(command, str) else " ".join(command)


def _saga_source() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "saga").rglob("*.py"))


def test_the_whole_deployment_is_there_and_every_long_running_service_has_a_healthcheck() -> None:
    assert set(SERVICES) == {
        "redis",
        "postgres",
        "migrate",
        "worker",
        "turns",
        "beat",
        "flower",
        "api",
    }
    for name in set(SERVICES) - {"migrate"}:
        check = SERVICES[name]["healthcheck"]
        assert "test" in check, name
        # a short start period: a service is known healthy (or not) within half a minute
        assert int(check["start_period"].removesuffix("s")) <= 30, name
        assert SERVICES[name]["restart"] == "unless-stopped", name


def test_every_saga_service_runs_the_image_and_installs_nothing_at_start() -> None:
    for name in OURS:
        service = SERVICES[name]
        assert service["build"] == {"context": ".", "target": "demo"}, name
        assert service["image"] == SERVICES["migrate"]["image"], name
        assert "volumes" not in service or all(":/app" not in v for v in service["volumes"])
        command = _command(name)
        assert not re.search(r"\b(pip|uv|poetry)\b|install", command), (name, command)


def test_the_app_is_one_variable() -> None:
    """SAGA_APP (default the demo's) is set once per service; the commands derive the module
    from it, and the demo's module is written nowhere else."""
    text = (ROOT / "compose.yaml").read_text()
    assert text.count("tasks.app") == 2  # SAGA_APP's default: x-saga-env (the API too), Flower
    assert text.count("${SAGA_APP:-tasks.app:saga}") == 2
    for name in ("worker", "turns", "beat"):
        assert f"celery -A {APP_MODULE}" in _command(name), name
        assert SERVICES[name]["environment"]["SAGA_APP"] == "${SAGA_APP:-tasks.app:saga}"


def test_each_worker_has_a_node_name_of_its_own_and_its_healthcheck_pings_it() -> None:
    for name, node in (("worker", "tools"), ("turns", "turns")):
        assert f"-n {node}@%h" in _command(name), name
        test = " ".join(SERVICES[name]["healthcheck"]["test"])
        assert f'inspect ping -d "{node}@$$HOSTNAME"' in test, name


def test_the_migrations_run_once_before_anything_writes_to_the_database() -> None:
    assert SERVICES["migrate"]["command"] == ["saga", "db", "upgrade"]
    assert SERVICES["migrate"]["restart"] == "no"
    assert SERVICES["migrate"]["environment"]["SAGA_DATABASE_URL"].startswith("postgresql+")
    for name in (*WORKERS, "api"):
        depends = SERVICES[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_every_saga_setting_it_passes_is_one_saga_reads() -> None:
    source = _saga_source()
    for name in OURS:
        for variable in SERVICES[name].get("environment", {}):
            if variable.startswith("SAGA_") and not variable.startswith("SAGA_API_"):
                # a *_FILE variable is read through secret_from_env("SAGA_..._PASSWORD")
                read_as = variable.removesuffix("_FILE")
                assert f'"{read_as}"' in source, f"{name}: {variable} is read nowhere"


def test_no_secret_is_written_in_the_file_nor_in_a_url() -> None:
    secret = re.compile(r"PASSWORD|SECRET|BASIC_AUTH")
    files = {s["file"] for s in COMPOSE["secrets"].values()}
    assert all(f.startswith("./secrets/") for f in files)
    for name, service in SERVICES.items():
        for variable, value in service.get("environment", {}).items():
            if variable.endswith("_FILE"):
                assert str(value).startswith("/run/secrets/"), (name, variable)
                secret_name = str(value).removeprefix("/run/secrets/")
                assert secret_name in service["secrets"], (name, variable)
            elif secret.search(variable):
                assert str(value).startswith("${"), f"{name}: {variable} is written in the file"
            if str(value).startswith(("redis://", "postgresql")):
                assert urlsplit(str(value)).password is None, f"{name}: {variable} has one"
    assert REQUIRED.match(SERVICES["flower"]["environment"][BASIC_AUTH_ENV])


def test_redis_has_a_user_per_role_and_no_default_user() -> None:
    script = SERVICES["redis"]["entrypoint"][2]
    assert "--user default off" in script
    users = dict(re.findall(r"--user (\w+) on \"#\$\$\(h (\w+)\)\"", script))
    assert users == {
        "saga": "redis_saga_password",
        "flower": "redis_flower_password",
        "readonly": "redis_readonly_password",
    }
    readonly = script.split("--user readonly", 1)[1]
    assert "-@all +@read" in readonly and "'%R~saga:*'" in readonly  # read, saga's keys only
    logins = {
        "worker": "saga",
        "turns": "saga",
        "beat": "saga",
        "migrate": "saga",
        "flower": "flower",
        "api": "saga",
    }
    for name, user in logins.items():
        env = SERVICES[name]["environment"]
        for variable in ("SAGA_BROKER_URL", "SAGA_RESULT_BACKEND", "SAGA_REDIS_URL"):
            if variable in env:
                assert urlsplit(env[variable]).username == user, (name, variable)
        password = f"/run/secrets/redis_{user}_password"
        assert env["SAGA_REDIS_PASSWORD_FILE"] == password, name


def test_the_api_serves_operators_on_the_loopback_and_never_migrates() -> None:
    """The API's tokens decide who may act; what acts (abort, approve, requeue, resolve) writes
    the run, sends its turns and records the action, so it has the workers' credentials."""
    api = SERVICES["api"]
    assert api["command"] == ["saga", "serve"]
    env = api["environment"]
    assert (env["SAGA_API_HOST"], env["SAGA_API_PORT"]) == ("0.0.0.0", "8000")
    assert api["ports"] == ["127.0.0.1:8000:8000"]
    check = " ".join(api["healthcheck"]["test"])
    assert "urllib.request.urlopen('http://127.0.0.1:8000/health/live'" in check
    assert urlsplit(env["SAGA_DATABASE_URL"]).username == "saga"
    assert urlsplit(env["SAGA_BROKER_URL"]).username == "saga"
    assert env["SAGA_APP"] == "${SAGA_APP:-tasks.app:saga}"
    assert env["SAGA_DB_AUTO_UPGRADE"] == "0"
    assert "SAGA_NOTIFY_WEBHOOK_SECRET" not in env
    role = COMPOSE["configs"]["postgres-readonly-role"]["content"]
    assert "CREATE ROLE saga_readonly LOGIN PASSWORD :'password'" in role
    assert "GRANT SELECT ON TABLES TO saga_readonly" in role
    assert not re.search(r"GRANT (INSERT|UPDATE|DELETE|ALL)", role)


def test_flower_is_the_locked_down_launcher_with_its_password_required() -> None:
    command = _command("flower")
    assert command == "python -m saga.integrations.flower --port=5555"
    assert importlib.util.find_spec("saga.integrations.flower") is not None
    assert "basic" not in command and " flower" not in command.replace("integrations.flower", "")
    assert all(p.startswith("127.0.0.1:") for p in SERVICES["flower"]["ports"])
    # Flower needs neither the database nor the webhook's secret
    assert not {"SAGA_DATABASE_URL", "SAGA_NOTIFY_WEBHOOK_SECRET"} & set(
        SERVICES["flower"]["environment"]
    )


def test_the_workers_serve_metrics() -> None:
    for name in WORKERS:
        command = _command(name)
        assert f"{METRICS_PORT_OPTION}=9808" in command
        assert "9808" in SERVICES[name]["expose"]
        assert SERVICES[name]["environment"]["SAGA_METRICS_ADDR"] == "0.0.0.0"


def test_beat_keeps_its_schedule_where_its_healthcheck_looks() -> None:
    assert "--schedule=/tmp/celerybeat-schedule" in _command("beat")
    assert "celerybeat-schedule" in " ".join(SERVICES["beat"]["healthcheck"]["test"])
