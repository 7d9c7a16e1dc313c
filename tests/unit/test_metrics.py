"""The metrics module counts without a server, and the worker takes the port option."""

from __future__ import annotations

from celery import Celery
from prometheus_client import REGISTRY

from saga import Saga, Settings, ToolRegistry, metrics


def test_counters_move_in_the_default_registry() -> None:
    before = REGISTRY.get_sample_value(
        "saga_steps_total", {"tool": "unit_tool", "outcome": "succeeded"}
    )
    metrics.step("unit_tool", "succeeded")
    after = REGISTRY.get_sample_value(
        "saga_steps_total", {"tool": "unit_tool", "outcome": "succeeded"}
    )
    assert (after or 0) - (before or 0) == 1


def test_the_worker_command_takes_a_metrics_port_option_or_its_variable() -> None:
    # A fresh app: importing tasks.app here would fix its settings to this process's env.
    app = Celery("unit-metrics")
    Saga(app, ToolRegistry(), Settings())
    [option] = [o for o in app.user_options["worker"] if "--metrics-port" in o.opts]
    assert option.envvar == "SAGA_METRICS_PORT"
    assert option.type.name == "integer"
