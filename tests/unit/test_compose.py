"""compose.yaml cannot be run here (no Docker engine), so check what it promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def test_redis_keeps_the_stack_durable_and_never_evicts_it() -> None:
    command = _compose()["services"]["redis"]["command"]
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "always"
    assert flags["--maxmemory-policy"] == "noeviction"


def test_every_saga_process_points_at_the_same_redis_and_the_reaper_runs() -> None:
    services = _compose()["services"]
    assert {"redis", "worker", "beat", "flower", "postgres"} <= set(services)
    for name in ("worker", "beat", "flower"):
        env = services[name]["environment"]
        assert env["SAGA_BROKER_URL"].startswith("redis://redis:6379/")
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "celery -A tasks.app beat" in services["beat"]["command"]
    assert services["worker"]["environment"]["SAGA_DATABASE_URL"].startswith("postgresql+")
