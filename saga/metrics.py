"""Prometheus metrics (``pip install 'saga-compensation[metrics]'``): what the workers did, by tool.

Counters move in the process where the thing happens (a step on the worker that ran it, a run
started in the process that called ``start_run``), in prometheus-client's default registry, so
an app that already exposes that registry shows them too. A worker started with
``--metrics-port`` (or ``SAGA_METRICS_PORT``) serves them itself: prefork children write to
prometheus-client's multiprocess files and the worker's main process serves the sum on that one
port, so a worker is one scrape target however many children it has or replaces.

Without prometheus-client installed every function here does nothing. None of them raises: a
metric must never fail a step.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from saga.extras import install_hint

logger = logging.getLogger("saga.metrics")

try:
    import prometheus_client
    from prometheus_client import values as _values
    from prometheus_client.core import GaugeMetricFamily, Metric
except ImportError:  # the optional extra is not installed
    prometheus_client = None  # type: ignore[assignment]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: How long the open escalations' count is reused between scrapes (one SQL query at most).
_ESCALATIONS_CACHE_SECONDS = 15.0
_DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
_DEPTH_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 55.0, 89.0)
#: A task's delivery or a model call: milliseconds to minutes.
_TASK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def installed() -> bool:
    """Whether prometheus-client could be imported (``--metrics-port`` refuses otherwise)."""
    return prometheus_client is not None


class _Metrics:
    def __init__(self) -> None:
        assert prometheus_client is not None
        counter, histogram = prometheus_client.Counter, prometheus_client.Histogram
        self.runs_started = counter("saga_runs_started", "Runs started (where start_run ran).")
        self.runs_ended = counter(
            "saga_runs_ended", "Runs ended and recorded, by final state.", ["state"]
        )
        self.steps = counter(
            "saga_steps",
            "Step deliveries by outcome: succeeded, retried, failed, rejected, in_doubt.",
            ["tool", "outcome"],
        )
        self.compensations = counter(
            "saga_compensations",
            "Compensation deliveries by outcome: done, retried, failed.",
            ["tool", "outcome"],
        )
        self.notices = counter(
            "saga_notices", "Escalation notices by sink and outcome.", ["sink", "outcome"]
        )
        self.unwind_duration = histogram(
            "saga_unwind_duration_seconds",
            "From an unwind's chain being sent to the run's conclusion, by final state.",
            ["state"],
            buckets=_DURATION_BUCKETS,
        )
        self.stack_depth = histogram(
            "saga_stack_depth",
            "Undo entries on a run's stack when its unwind is sent.",
            buckets=_DEPTH_BUCKETS,
        )
        self.step_duration = histogram(
            "saga_step_duration_seconds",
            "One delivery of a step's task, start to end, by tool and outcome (as saga_steps).",
            ["tool", "outcome"],
            buckets=_TASK_BUCKETS,
        )
        self.compensation_duration = histogram(
            "saga_compensation_duration_seconds",
            "One delivery of a compensation's task, by tool and outcome: done, retried, failed.",
            ["tool", "outcome"],
            buckets=_TASK_BUCKETS,
        )
        self.turns = counter(
            "saga_turns", "Hosted turn deliveries by outcome: played, retried, failed.", ["outcome"]
        )
        self.model_calls = counter(
            "saga_model_calls",
            "Model calls of hosted agents by outcome: answered, failed.",
            ["agent", "model", "outcome"],
        )
        self.model_call_duration = histogram(
            "saga_model_call_duration_seconds",
            "One model call of a hosted agent, answered or failed.",
            ["agent", "model"],
            buckets=_TASK_BUCKETS,
        )
        self.model_tokens = counter(
            "saga_model_tokens",
            "Tokens of answered model calls: direction in (the prompt) or out (the answer).",
            ["agent", "model", "direction"],
        )


_metrics: _Metrics | None = None
_lock = threading.Lock()
_failed_once = False


def _use(action: Callable[[_Metrics], Any]) -> None:
    global _metrics, _failed_once
    if prometheus_client is None:
        return
    try:
        if _metrics is None:
            with _lock:
                if _metrics is None:
                    _metrics = _Metrics()
        action(_metrics)
    except Exception:
        if not _failed_once:  # once: a full disk must not flood the log either
            _failed_once = True
            logger.exception("saga metrics could not be updated")


def run_started() -> None:
    _use(lambda m: m.runs_started.inc())


def run_ended(state: str) -> None:
    _use(lambda m: m.runs_ended.labels(state).inc())


def step(tool: str, outcome: str) -> None:
    _use(lambda m: m.steps.labels(tool, outcome).inc())


def compensation(tool: str, outcome: str) -> None:
    _use(lambda m: m.compensations.labels(tool, outcome).inc())


def notice(sink: str, outcome: str) -> None:
    _use(lambda m: m.notices.labels(sink, outcome).inc())


def unwind_ended(state: str, seconds: float) -> None:
    _use(lambda m: m.unwind_duration.labels(state).observe(max(0.0, seconds)))


def stack_depth(entries: int) -> None:
    _use(lambda m: m.stack_depth.observe(entries))


def task_duration(kind: str, tool: str, outcome: str, seconds: float) -> None:
    """One delivery of a tool's task (``kind``: step or compensation)."""

    def observe(m: _Metrics) -> None:
        histogram = m.step_duration if kind == "step" else m.compensation_duration
        histogram.labels(tool, outcome).observe(max(0.0, seconds))

    _use(observe)


def turn(outcome: str) -> None:
    _use(lambda m: m.turns.labels(outcome).inc())


def model_call(agent: str, model: str, outcome: str, seconds: float) -> None:
    def observe(m: _Metrics) -> None:
        m.model_calls.labels(agent, model, outcome).inc()
        m.model_call_duration.labels(agent, model).observe(max(0.0, seconds))

    _use(observe)


def tokens(agent: str, model: str, input_tokens: int, output_tokens: int) -> None:
    def count(m: _Metrics) -> None:
        m.model_tokens.labels(agent, model, "in").inc(max(0, input_tokens))
        m.model_tokens.labels(agent, model, "out").inc(max(0, output_tokens))

    _use(count)


# -- serving, from a worker -------------------------------------------------------------------


class _OpenEscalations:
    """``saga_escalations_open``, counted in the records database at scrape time (cached), so
    every worker reports the same number: aggregate it with ``max``, not ``sum``."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count
        self._cached: tuple[float, int] | None = None

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > _ESCALATIONS_CACHE_SECONDS:
            try:
                self._cached = (now, self._count())
            except Exception as exc:
                logger.warning(
                    "saga_escalations_open: the records database did not answer: %s", exc
                )
                return
        yield GaugeMetricFamily(
            "saga_escalations_open",
            "Escalations not resolved yet (the whole deployment's, from the records database).",
            value=self._cached[1],
        )


class MetricsServer:
    """The HTTP endpoint of one worker: every process's metrics, summed, on one port."""

    def __init__(self, port: int, address: str, open_escalations: Callable[[], int]) -> None:
        if prometheus_client is None:
            raise RuntimeError(f"--metrics-port needs prometheus-client: {install_hint('metrics')}")
        # An optional extra: imported where it is used.
        from prometheus_client import multiprocess

        self._own_directory = ""
        if not os.environ.get(MULTIPROC_ENV):
            # A fresh directory per worker start: counters begin at zero with the process,
            # as Prometheus expects of a restarted target.
            self._own_directory = tempfile.mkdtemp(prefix="saga-metrics-")
            os.environ[MULTIPROC_ENV] = self._own_directory
        # Metrics made from now on (in this process and in the pool's children, forked later)
        # write to the directory, even if prometheus-client was imported before it was set.
        _values.ValueClass = _values.get_value_class()  # type: ignore[no-untyped-call]
        global _metrics
        with _lock:
            if _metrics is not None:  # made before: unregister, and make them again
                for collector in vars(_metrics).values():
                    prometheus_client.REGISTRY.unregister(collector)
                _metrics = None
        self.registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
        self.registry.register(_OpenEscalations(open_escalations))
        self._server, _ = prometheus_client.start_http_server(port, address, registry=self.registry)
        self.port = int(self._server.server_address[1])
        logger.info("saga metrics on http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._own_directory:
            shutil.rmtree(self._own_directory, ignore_errors=True)
            os.environ.pop(MULTIPROC_ENV, None)
