"""A tool registered after ``Saga(app, tools)`` runs like the others (its task is installed at
once, in the caller and in the worker that imported it), and a tool only the caller knows is
refused at the call, named by the worker as it starts and by ``saga doctor``: never a message
the worker drops and a step that waits for the reaper."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga import StepContext, ToolClass
from saga.errors import UnknownToolError
from saga.testing import WorkerProcess
from tests.conftest import ROOT

SAGA = str(Path(sys.executable).with_name("saga"))
APP = "tests.integration.late_tools_app"


@pytest.fixture(scope="module")
def late_app(saga_env: dict[str, str]) -> Any:
    """The app, imported here as a caller imports it, plus a tool that only this process
    registers (the worker never will)."""
    import tests.integration.late_tools_app as module

    if "caller_only" not in {tool.name for tool in module.tools}:

        @module.tools.tool(ToolClass.READ)
        def caller_only(ctx: StepContext, n: int) -> dict[str, int]:
            return {"caller": n}

    return module


@pytest.fixture(scope="module")
def late_worker(saga_env: dict[str, str], late_app: Any) -> Iterator[WorkerProcess]:
    """The app's worker, started after this caller's first call (which published the tools
    this caller knows); that call's step waits for it, and completes."""
    early = late_app.saga.start_run()
    first = early.call("early", n=0)
    process = WorkerProcess(APP, env=saga_env, extra_args=["-Q", late_app.QUEUE], cwd=ROOT)
    with process:
        assert first.result(timeout=30) == {"early": 0}
        assert early.finish(timeout=30).state.value == "completed"
        yield process


def test_a_tool_registered_after_the_saga_runs_on_the_worker(
    late_app: Any, late_worker: WorkerProcess
) -> None:
    # Given a run of the app whose last tool was registered after its Saga
    run = late_app.saga.start_run()

    # When the late tool is called
    result = run.call("registered_late", n=7).result(timeout=30)

    # Then the worker ran it (its message was not dropped as unregistered)
    assert result == {"late": 7}
    assert "unregistered task" not in late_worker.log()
    assert run.finish(timeout=30).state.value == "completed"


def test_a_tool_no_worker_runs_is_refused_at_the_call(
    late_app: Any, late_worker: WorkerProcess
) -> None:
    # Given a run, and a tool this caller registered that the workers do not run
    run = late_app.saga.start_run()

    # When it is called
    with pytest.raises(UnknownToolError, match=r"no worker runs tool 'caller_only'"):
        run.call("caller_only", n=1)

    # Then nothing was reserved: the run has no step, and ends at once
    assert late_app.saga.picture(run.run_id).steps == []
    assert run.finish(timeout=30).state.value == "completed"


def test_the_worker_start_and_doctor_name_the_tool_the_caller_knows(
    late_app: Any, late_worker: WorkerProcess, saga_env: dict[str, str]
) -> None:
    # The worker's start-up named it (the caller published its tools before it started)
    assert "callers know tools this worker does not register" in late_worker.log()
    warned = next(line for line in late_worker.log().splitlines() if "callers know tools" in line)
    assert "caller_only" in warned and "registered_late" not in warned

    # And doctor says which worker lacks it
    done = subprocess.run(
        [SAGA, "--app", f"{APP}:saga", "doctor", "--json"],
        env={**saga_env, "PATH": str(Path(sys.executable).parent)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    checks = {check["name"]: check for check in json.loads(done.stdout)["checks"]}
    tools = checks["tools"]
    assert tools["status"] == "fail", tools
    node = late_worker.hostname.split("@")[0]
    mine = next(part for part in tools["detail"].split("; ") if node in part)
    assert "caller_only" in mine and "registered_late" not in mine
