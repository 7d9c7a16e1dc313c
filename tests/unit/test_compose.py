"""compose.yaml cannot be run here (no Docker engine), so check what it promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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
    assert {"redis", "worker", "turns", "beat", "flower", "postgres"} <= set(services)
    for name in ("worker", "turns", "beat", "flower"):
        broker = urlsplit(services[name]["environment"]["SAGA_BROKER_URL"])
        assert (broker.scheme, broker.hostname, broker.port) == ("redis", "redis", 6379), name
        assert broker.path == "/0" and broker.password is None, name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert 'celery -A "$${SAGA_APP%%:*}" beat' in " ".join(services["beat"]["command"])
    assert services["worker"]["environment"]["SAGA_DATABASE_URL"].startswith("postgresql+")


def test_turns_run_on_a_threads_pool_on_their_own_queue() -> None:
    """Model calls never hold a prefork slot: the turn worker serves saga.turns with threads,
    and the tool worker does not consume that queue."""
    import celeryconfig
    from saga.constants import AGENT_TURN_TASK, TURN_QUEUE

    services = _compose()["services"]
    turns = " ".join(services["turns"]["command"])
    assert "-P threads" in turns and f"-Q {TURN_QUEUE}" in turns
    assert "-Q celery" in " ".join(services["worker"]["command"])
    assert celeryconfig.task_routes[AGENT_TURN_TASK] == {"queue": TURN_QUEUE}
    assert services["turns"]["environment"]["SAGA_DATABASE_URL"].startswith("postgresql+")
