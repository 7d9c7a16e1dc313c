"""The public surface: what ``saga`` exports, how its errors are shaped, and which modules stay
free of Celery and of the demo app.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import saga
from saga import errors
from saga.errors import InvalidArgumentsError, SagaError, StoreUnavailableError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "saga"

EXPORTED = [
    # Declaring tools
    "RetryPolicy",
    "StepContext",
    "Tool",
    "ToolClass",
    "ToolRegistry",
    "ToolRejected",
    "Undo",
    # Running an agent
    "Run",
    "Saga",
    "SagaHooks",
    "Settings",
    "OnFailure",
    "StepHandle",
    # What a run looks like
    "ActionRecord",
    "CompensationRecord",
    "CompensationState",
    "EscalationRecord",
    "RecordStore",
    "ReapReport",
    "RunPicture",
    "RunRecord",
    "RunState",
    "StepRecord",
    "StepState",
    # Errors
    "CallRefusedError",
    "CompensationBuildError",
    "CompensationNotBuiltError",
    "ConfigurationError",
    "DatabaseSchemaError",
    "DispatchError",
    "EscalationResolvedError",
    "FaultInjectionDisabledError",
    "InjectedFaultError",
    "InvalidArgumentsError",
    "InvalidCorrectionError",
    "InvalidRunIdError",
    "InvalidRunOptionError",
    "InvalidTextError",
    "MessageNotSentError",
    "NonRetryableToolError",
    "NothingToRequeueError",
    "OperationRefusedError",
    "PayloadError",
    "RunContendedError",
    "RunEndedError",
    "RunExistsError",
    "SagaError",
    "StepFailedError",
    "StepInDoubtError",
    "StepRejectedError",
    "StepSkippedError",
    "StepsInFlightError",
    "StoreUnavailableError",
    "ToolDefinitionError",
    "ToolNotOfferedError",
    "ToolResultError",
    "UnknownEscalationError",
    "UnknownRunError",
    "UnknownToolError",
    "WaitTimeoutError",
]

ERROR_CLASSES = [
    obj
    for _, obj in inspect.getmembers(errors, inspect.isclass)
    if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
]

#: Only these modules may talk to Celery; the rules and the stack must not need it. The web
#: app's client builds a Celery app of its own, to send tasks by name.
CELERY_MODULES = {
    "engine.py",
    "core.py",
    "dispatch.py",
    "worker.py",
    "forward.py",
    "compensation.py",
    "delivery.py",
    "client.py",
    "unwind.py",
    "prepared_publish.py",
}
_CELERY_IMPORT = re.compile(r"^\s*(import\s+celery\b|from\s+celery\b)", re.MULTILINE)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_all_is_pinned() -> None:
    """``saga.__all__`` is exactly the agreed list, in the agreed order."""
    assert saga.__all__ == EXPORTED


@pytest.mark.parametrize("name", EXPORTED)
def test_every_exported_name_is_importable(name: str) -> None:
    """``from saga import X`` works for every name in ``__all__``."""
    namespace: dict[str, object] = {}
    exec(f"from saga import {name}", namespace)
    assert namespace[name] is getattr(saga, name)


def test_errors_module_is_found() -> None:
    """The error list below holds at least every exported error."""
    names = {cls.__name__ for cls in ERROR_CLASSES}
    exported_errors = {n for n in EXPORTED if n.endswith("Error")}
    assert exported_errors <= names
    assert len(exported_errors) == 36


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_subclasses_saga_error_and_is_documented(cls: type[Exception]) -> None:
    """One root for every error, and every error says what it means."""
    assert issubclass(cls, SagaError)
    doc = cls.__dict__.get("__doc__")
    assert doc is not None
    assert doc.strip() != ""


def test_retryable_is_an_attribute_of_the_error() -> None:
    """The worker asks the error whether to retry: the store being down is worth it, bad
    arguments never are."""
    assert StoreUnavailableError.retryable is True
    assert StoreUnavailableError("down").retryable is True
    assert InvalidArgumentsError.retryable is False
    assert InvalidArgumentsError("bad").retryable is False
    assert SagaError.retryable is False


def test_saga_does_not_import_the_demo_tasks() -> None:
    """The library never pulls in the demo application (``tasks``)."""
    done = _python(
        "import saga, sys; "
        "assert not any(m == 'tasks' or m.startswith('tasks.') for m in sys.modules), "
        "sorted(m for m in sys.modules if m.split('.')[0] == 'tasks')"
    )
    assert done.returncode == 0, done.stderr


def test_the_subprocess_check_can_fail() -> None:
    """The check above would notice ``tasks`` if it were imported."""
    done = _python(
        "import saga, sys, types; sys.modules['tasks.app'] = types.ModuleType('tasks.app'); "
        "assert not any(m == 'tasks' or m.startswith('tasks.') for m in sys.modules)"
    )
    assert done.returncode != 0
    assert "AssertionError" in done.stderr


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.glob("*.py") if p.name not in CELERY_MODULES),
    ids=lambda p: p.name,
)
def test_only_engine_and_worker_import_celery(path: Path) -> None:
    """Rules, stack, model, tools (and the rest) import no Celery."""
    source = path.read_text()
    assert _CELERY_IMPORT.findall(source) == []


def test_core_modules_are_among_the_celery_free_ones() -> None:
    """The modules the rules need exist and are covered by the check above."""
    checked = {p.name for p in PACKAGE.glob("*.py")} - CELERY_MODULES
    assert {"rules.py", "stack.py", "model.py", "tools.py"} <= checked
    for name in CELERY_MODULES:
        assert _CELERY_IMPORT.search((PACKAGE / name).read_text()) is not None


def test_core_modules_do_not_import_the_celery_modules() -> None:
    """Neither can they reach Celery through ``saga.engine`` or ``saga.worker``."""
    forbidden = re.compile(
        r"^\s*(from\s+saga\s+import\s+.*\b(engine|worker)\b|"
        r"(from|import)\s+saga\.(engine|worker)\b)",
        re.MULTILINE,
    )
    for name in ("rules.py", "stack.py", "model.py", "tools.py", "payload.py", "retry.py"):
        assert forbidden.findall((PACKAGE / name).read_text()) == [], name
        importlib.import_module(f"saga.{name.removesuffix('.py')}")
