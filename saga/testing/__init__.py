"""Test helpers for saga and for its users' own tools.

Compensations only run when something already broke, so they are exactly the code that needs
tests against a real worker; these make that cheap:

- ``processes``: a private ``redis-server`` and a real Celery worker, stopped by PID;
- ``faults``: failures injected into real workers (``Faults``, per tool ``ToolFaults``);
- ``fake_models``: a scripted model that answers in each wire format saga speaks, through the
  SDK's own transport or on a loopback port the workers reach;
- ``plugin``: the pytest plugin (fixtures ``saga_app``, ``saga_worker``, ``saga_faults``,
  ``saga_model``, ...), loaded by ``pip install saga``. See ``docs/testing.md``.

Only the first two are imported here: the workers import this package for fault injection.
"""

from saga.testing.faults import (
    FAULT_POINTS,
    FAULTS_ENV,
    TOOL_POINTS,
    Faults,
    ToolFaults,
    faults_enabled,
)
from saga.testing.processes import RedisServer, WorkerProcess, free_port

__all__ = [
    "FAULTS_ENV",
    "FAULT_POINTS",
    "TOOL_POINTS",
    "Faults",
    "RedisServer",
    "ToolFaults",
    "WorkerProcess",
    "faults_enabled",
    "free_port",
]
