"""What tracing costs a worker: CPU seconds per step with tracing off and on.

Each mode starts a private ``redis-server`` and one worker on the demo app (two prefork
processes), drives ``--steps`` reads (``get_order``) through runs of ten steps, stops the
worker, and takes the CPU time of the worker and its pool from ``getrusage(RUSAGE_CHILDREN)``.
A run of the same worker with no steps is subtracted (start-up and shutdown), so what is left
is the steps' own CPU. Modes:

- ``off``: opentelemetry installed, no tracer provider set (the default: no span is made);
- ``on``: the SDK's ``TracerProvider`` with a ``SimpleSpanProcessor`` handing each span to an
  exporter that drops it: the cost of making saga's spans, not of shipping them.

It also prints the hooks' own cost in this process (a wrapped no-op task, 20,000 calls).
Timings are reported, never asserted.

    .venv/bin/python benchmarks/tracing.py --steps 300
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETUP = "benchmarks.tracing_setup"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def worker_cpu(mode: str, steps: int, tmp: Path) -> float:
    """CPU seconds of one worker's life in ``mode`` that ran ``steps`` steps."""
    from saga.testing import RedisServer, WorkerProcess

    data = tmp / f"{mode}-{steps}"
    data.mkdir()
    with RedisServer(directory=data / "redis") as server:
        url = f"{server.url}/0"
        env = {
            "SAGA_REDIS_URL": url,
            "SAGA_BROKER_URL": url,
            "SAGA_RESULT_BACKEND": url,
            "SAGA_DEMO_DATA": str(data),
            "SAGA_DATABASE_URL": f"sqlite:///{data / 'saga.db'}",
            "SAGA_BENCH_TRACING": mode,
            "PYTHONPATH": str(ROOT),
        }
        os.environ.update(env)
        from tasks import systems

        systems.dispose_engines()
        systems.reset()  # the demo's order, in this mode's own data directory
        saga = _saga(url)
        before = children_cpu()
        worker = WorkerProcess("tasks.app", env=env, cwd=ROOT, extra_args=["--include", SETUP])
        with worker:
            for first in range(0, steps, 10):
                run = saga.start_run()
                for _ in range(min(10, steps - first)):
                    run.call("get_order", order_id=4921).result(timeout=30)
                run.finish(timeout=30)
        cpu = children_cpu() - before
        saga.store.client.close()
        return cpu


def _saga(url: str) -> Any:
    from celery import Celery

    from saga import Saga, Settings
    from tasks.tools import tools

    app = Celery("bench-tracing")
    app.conf.update(broker_url=url, result_backend=url, task_serializer="json")
    return Saga(app, tools, Settings(redis_url=url, database_url=os.environ["SAGA_DATABASE_URL"]))


def hook_cost(calls: int = 20_000) -> dict[str, float]:
    """Microseconds per wrapped call of a no-op task, tracing off and on."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from benchmarks.tracing_setup import Drop
    from saga.telemetry import traced_tool, tracing
    from tasks.tools import tools

    class Task:
        class request:
            retries = 0

    wrapped = traced_tool(tools.get("get_order"))(lambda *args: {"ok": True})
    costs = {}
    for mode in ("off", "on"):
        if mode == "on":
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(Drop()))
            trace.set_tracer_provider(provider)
        tracing._cache[:] = [None, None]
        began = time.process_time()
        for _ in range(calls):
            wrapped(Task(), "r", 1, {}, None, "")
        costs[mode] = (time.process_time() - began) / calls * 1e6
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    hooks = hook_cost()
    print(f"hook, in process: off {hooks['off']:.1f} µs/call, on {hooks['on']:.1f} µs/call")
    with tempfile.TemporaryDirectory(prefix="saga-bench-tracing-") as tmp:
        for mode in ("off", "on"):
            idle = worker_cpu(mode, 0, Path(tmp))
            busy = worker_cpu(mode, options.steps, Path(tmp))
            per_step = (busy - idle) / options.steps * 1000
            print(f"worker, tracing {mode}: {per_step:.2f} ms CPU per step ({options.steps} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
