"""``benchmarks.bench_app`` with Celery's failure handling timed in each pool child, for
``benchmarks/failures.py``: the thread CPU of ``TraceInfo.handle_failure`` (the failure's
``ExceptionInfo`` and its log) added up in Redis. ``SAGA_BENCH_WHOLE_TRACEBACKS=1`` puts back
the way before round six: a tool's failure raised with saga's delivery frames above it.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from celery.app.trace import TraceInfo

from benchmarks import bench_app
from benchmarks.bench_app import app, saga

__all__ = ["FAILURE_CPU_KEY", "app", "saga"]

#: Where the children add up their failure handling's CPU seconds (a float, INCRBYFLOAT).
FAILURE_CPU_KEY = "bench:failure-handling-cpu"

if os.environ.get("SAGA_BENCH_WHOLE_TRACEBACKS") == "1":
    import saga.worker

    saga.worker.from_the_tool = lambda exc: None  # type: ignore[assignment]

_handle_failure = TraceInfo.handle_failure


@functools.wraps(_handle_failure)
def _timed(self: TraceInfo, *args: Any, **kwargs: Any) -> Any:
    began = time.thread_time()
    try:
        return _handle_failure(self, *args, **kwargs)
    finally:
        bench_app._redis().incrbyfloat(FAILURE_CPU_KEY, time.thread_time() - began)


TraceInfo.handle_failure = _timed  # type: ignore[method-assign]
