"""What the Flower launcher starts, and which of Flower's own routes it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from saga.errors import ConfigurationError
from saga.integrations.flower import BASIC_AUTH_ENV, INSECURE_LOCAL_ENV, guard_routes, plan


def test_credentials_come_from_the_environment() -> None:
    argv, env = plan(["-A", "tasks.app", "--port=5555"], {BASIC_AUTH_ENV: "ops:pw,viewer:pw2"})
    assert argv == ["celery", "-A", "tasks.app", "flower", "--port=5555"]
    assert env == {"FLOWER_BASIC_AUTH": "ops:pw,viewer:pw2"}


def test_without_credentials_it_refuses_to_start() -> None:
    with pytest.raises(ConfigurationError, match=BASIC_AUTH_ENV):
        plan(["-A", "tasks.app"], {})


@pytest.mark.parametrize("credentials", ["ops", "ops:", ":pw", "ops:pw,"])
def test_incomplete_credentials_are_refused(credentials: str) -> None:
    with pytest.raises(ConfigurationError, match="user:password"):
        plan(["-A", "tasks.app"], {BASIC_AUTH_ENV: credentials})


@pytest.mark.parametrize("flag", ["--basic_auth=ops:pw", "--basic-auth=ops:pw"])
def test_credentials_on_the_command_line_are_refused(flag: str) -> None:
    with pytest.raises(ConfigurationError, match="not taken on the command line"):
        plan(["-A", "tasks.app", flag], {BASIC_AUTH_ENV: "ops:pw"})


def test_local_development_without_credentials_listens_on_loopback_only() -> None:
    argv, env = plan(["-A", "tasks.app"], {INSECURE_LOCAL_ENV: "1"})
    assert argv[-1] == "--address=127.0.0.1"
    assert env == {}
    with pytest.raises(ConfigurationError, match=r"127\.0\.0\.1 only"):
        plan(["-A", "tasks.app", "--address=0.0.0.0"], {INSECURE_LOCAL_ENV: "1"})


def test_every_api_route_but_the_read_only_ones_is_refused() -> None:
    """Checked against Flower's own route table, so a route a new version adds is refused."""
    import flower.urls

    guarded = dict(
        (h[0], h[1].__name__) for h in guard_routes(flower.urls.handlers) if isinstance(h, tuple)
    )
    allowed = {p for p, name in guarded.items() if p.startswith("/api/") and name != "Refused"}
    assert allowed == {
        r"/api/workers",
        r"/api/tasks",
        r"/api/task/types",
        r"/api/queues/length",
        r"/api/task/info/(.*)",
        r"/api/task/result/(.+)",
    }
    for control in (
        "/api/task/revoke/(.+)",
        "/api/task/async-apply/(.+)",
        "/api/task/send-task/(.+)",
        "/api/worker/shutdown/(.+)",
    ):
        assert guarded[control] == "Refused"
    assert guarded["/metrics"] == "AuthenticatedMetrics"


def test_a_control_route_declared_with_url_is_refused_too() -> None:
    """A later Flower may declare its API with tornado's url(...): the guard reads those too."""
    from flower.api.control import TaskRevoke
    from flower.views.tasks import TaskView
    from tornado.routing import URLSpec

    page = URLSpec(r"/task/(.+)", TaskView, name="task")
    guarded = guard_routes([URLSpec(r"/api/task/revoke/(.+)", TaskRevoke, name="revoke"), page])

    assert [type(h) for h in guarded] == [URLSpec, URLSpec]
    assert guarded[0].handler_class.__name__ == "Refused" and guarded[0].name == "revoke"
    assert guarded[1] is page


@pytest.mark.parametrize(
    "config",
    [
        "basic_auth = []\n",
        "unauthenticated_api = True\n",
        "auth = '.*@example.com'\n",
        "exec('basic_auth = []')\n",
        "import os\nport = 1\n",
        "globals()['basic_auth'] = []\n",
    ],
)
def test_a_flowerconfig_that_could_open_flower_refuses_the_start(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower executes flowerconfig.py after the environment: it is screened first."""
    (tmp_path / "flowerconfig.py").write_text(config)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=r"flowerconfig\.py"):
        plan(["-A", "tasks.app"], {BASIC_AUTH_ENV: "ops:pw"})
    (tmp_path / "other.py").write_text(config)
    with pytest.raises(ConfigurationError, match=r"other\.py"):
        plan(["-A", "tasks.app", "--conf=other.py"], {BASIC_AUTH_ENV: "ops:pw"})


def test_a_flowerconfig_of_plain_settings_is_let_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flowerconfig.py").write_text('"""Ours."""\nport = 5556\nurl_prefix = "flower"\n')
    monkeypatch.chdir(tmp_path)
    argv, _ = plan(["-A", "tasks.app"], {BASIC_AUTH_ENV: "ops:pw"})
    assert argv == ["celery", "-A", "tasks.app", "flower"]


def test_the_app_comes_from_saga_app_without_a() -> None:
    argv, _ = plan(["--port=5555"], {BASIC_AUTH_ENV: "ops:pw", "SAGA_APP": "myproject.worker:saga"})
    assert argv == ["celery", "-A", "myproject.worker", "flower", "--port=5555"]
    with pytest.raises(ConfigurationError, match="SAGA_APP"):
        plan(["--port=5555"], {BASIC_AUTH_ENV: "ops:pw"})
