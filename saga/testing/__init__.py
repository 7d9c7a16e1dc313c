"""Test helpers for saga and for its users' own tools.

Compensations only run when something already broke, so they are exactly the code that needs
tests against a real worker; these make that cheap:

- ``processes``: a private ``redis-server`` and a real Celery worker, stopped by PID;
- ``faults``: failures injected into real workers (``Faults``, per tool ``ToolFaults``);
- ``fake_models``: a scripted model that answers in each wire format saga speaks, through the
  SDK's own transport or on a loopback port the workers reach;
- ``drill``: one scenario replayed once per fault, judged by the tools' ``verify``
  (``Drill``; ``saga drill`` on the command line); ``drill_hosted``: a hosted agent, played
  by a fake model's script, as the scenario (``HostedScenario``, ``HostedDrill``);
- ``plugin``: the pytest plugin (fixtures ``saga_app``, ``saga_worker``, ``saga_faults``,
  ``saga_model``, ``saga_drill``, ...), loaded by ``pip install saga-compensation``. See
  ``docs/testing.md``.

The names below load their module on first use: the pytest plugin (``saga.testing.plugin``,
loaded by every pytest run where saga is installed) must cost nothing until a test asks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# For type checkers: these names are exported lazily (``__getattr__`` below), so importing the
# kit loads no worker process code until a name is used.
if TYPE_CHECKING:
    from saga.testing.drill import Drill, DrillReport
    from saga.testing.drill_hosted import HostedDrill, HostedScenario
    from saga.testing.faults import (
        FAULT_POINTS,
        FAULTS_ENV,
        TOOL_POINTS,
        Faults,
        ToolFaults,
        faults_enabled,
    )
    from saga.testing.processes import RedisServer, WorkerProcess, free_port

_LAZY = {
    "Drill": "saga.testing.drill",
    "DrillReport": "saga.testing.drill",
    "HostedDrill": "saga.testing.drill_hosted",
    "HostedScenario": "saga.testing.drill_hosted",
    "FAULT_POINTS": "saga.testing.faults",
    "FAULTS_ENV": "saga.testing.faults",
    "TOOL_POINTS": "saga.testing.faults",
    "Faults": "saga.testing.faults",
    "ToolFaults": "saga.testing.faults",
    "faults_enabled": "saga.testing.faults",
    "RedisServer": "saga.testing.processes",
    "WorkerProcess": "saga.testing.processes",
    "free_port": "saga.testing.processes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'saga.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Drill",
    "DrillReport",
    "FAULTS_ENV",
    "FAULT_POINTS",
    "TOOL_POINTS",
    "Faults",
    "HostedDrill",
    "HostedScenario",
    "RedisServer",
    "ToolFaults",
    "WorkerProcess",
    "faults_enabled",
    "free_port",
]
