"""``benchmarks.bench_app`` with two parts of a failing run timed in each pool child, for
``benchmarks/failures.py``: the thread CPU of Celery's ``TraceInfo.handle_failure`` (the
failure's ``ExceptionInfo`` and its log) and of ``Core.start_unwind`` (the unwind's chain made,
sent and marked), each added up in Redis. ``SAGA_BENCH_WHOLE_TRACEBACKS=1`` puts back the way
before round six: a tool's failure raised with saga's delivery frames above it.
``SAGA_BENCH_CELERY_CHAIN=1`` the way before round seven: the unwind's chain sent by Celery's
publish, then marked sent, and passed on from each undo by Celery's tracer once the undo is
recorded. ``SAGA_BENCH_FAILURE_APART=1`` the way before round eight: the final failure recorded
(with the run read back), then the chain pushed by the mark's script;
``SAGA_BENCH_CONCLUSION_APART=1`` the last undo recorded (with the run read back), then the
run concluded by a script of its own. The failed step's ``saga.forward._record_failure`` (the
failure recorded and the unwind started) is timed too.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from celery.app.trace import TraceInfo

import saga.compensation as saga_compensation
import saga.core as saga_core
import saga.forward as saga_forward
import saga.unwind as saga_unwind
import saga.worker as saga_worker
from benchmarks import bench_app
from benchmarks.bench_app import app, saga

__all__ = ["FAILURE_CPU_KEY", "RECORD_FAILURE_CPU_KEY", "UNWIND_CPU_KEY", "app", "saga"]

#: Where the children add up their failure handling's CPU seconds (a float, INCRBYFLOAT).
FAILURE_CPU_KEY = "bench:failure-handling-cpu"
#: And their unwinds' start.
UNWIND_CPU_KEY = "bench:start-unwind-cpu"
#: And the failed step's record of its failure, with the unwind it starts.
RECORD_FAILURE_CPU_KEY = "bench:record-failure-cpu"

if os.environ.get("SAGA_BENCH_WHOLE_TRACEBACKS") == "1":
    saga_worker.from_the_tool = lambda exc: None  # type: ignore[assignment]
if os.environ.get("SAGA_BENCH_CELERY_CHAIN") == "1":
    saga_unwind.prepared_chain = lambda publisher, signatures: None  # type: ignore[assignment]
    saga_compensation._prepared_rest = lambda core, task: None  # type: ignore[assignment]
if os.environ.get("SAGA_BENCH_FAILURE_APART") == "1":
    saga_forward._fail_and_push = lambda core, run_id, step, error: None  # type: ignore[assignment]
if os.environ.get("SAGA_BENCH_CONCLUSION_APART") == "1":

    def _recorded_apart(
        core: Any, task: Any, tool: Any, run_id: str, step: int, claim: str
    ) -> tuple[bool, Any]:
        recorded = saga_compensation._recorded_last(core, task, run_id, step, "done", None, claim)
        saga_compensation.metrics.compensation(tool.name, "done")
        return False, recorded

    saga_compensation._recorded_done_last = _recorded_apart  # type: ignore[assignment]


def _timed(key: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            bench_app._redis().incrbyfloat(key, time.thread_time() - began)

    return timed


TraceInfo.handle_failure = _timed(FAILURE_CPU_KEY, TraceInfo.handle_failure)  # type: ignore[method-assign]
saga_core.Core.start_unwind = _timed(UNWIND_CPU_KEY, saga_core.Core.start_unwind)  # type: ignore[method-assign]
saga_forward._record_failure = _timed(RECORD_FAILURE_CPU_KEY, saga_forward._record_failure)  # type: ignore[assignment]
