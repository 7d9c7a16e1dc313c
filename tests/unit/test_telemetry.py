"""The spans' structure without Celery's instrumentation, and tracing off: the hooks run in
this process against the SDK's in-memory exporter (``tests/integration/test_telemetry.py``
has them from a real worker, with Celery's instrumentation on)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import Retry
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from saga import RunState, StepContext, ToolClass, ToolRegistry, Undo, telemetry
from saga.picture import RunPicture
from saga.telemetry import tracing

tools = ToolRegistry()


@tools.tool(ToolClass.REVERSIBLE_WRITE, compensation=lambda a, r: Undo("undo_it", {}))
def do_it(ctx: StepContext) -> None:
    pass


@tools.compensation()
def undo_it() -> None:
    pass


class _Task:
    class request:
        retries = 0


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    tracing._cache[:] = [None, None]


def deliver(result: Any = None, raises: BaseException | None = None, **kwargs: Any) -> Any:
    def task(*args: Any) -> Any:
        if raises is not None:
            raise raises
        return result

    return telemetry.traced_tool(tools.get(kwargs.pop("tool", "do_it")))(task)(_Task(), **kwargs)


def test_without_a_tracer_provider_no_span_is_made() -> None:
    assert tracing.tracer() is None
    assert deliver({"ok": 1}, run_id="r", step=1) == {"ok": 1}


def test_without_celerys_span_a_step_is_a_child_of_its_runs_span(
    exported: InMemorySpanExporter,
) -> None:
    deliver({"ok": 1}, run_id="r-1", step=1)
    deliver(None, run_id="r-1", compensates=1, tool="undo_it")
    with pytest.raises(Retry):
        deliver(raises=Retry(), run_id="r-1", step=2)
    with pytest.raises(ValueError):
        deliver(raises=ValueError("down"), run_id="r-1", step=3)

    trace_id, span_id = tracing.run_ids("r-1")
    spans = exported.get_finished_spans()
    assert [s.name for s in spans] == ["saga.step do_it", "saga.compensation undo_it"] + [
        "saga.step do_it"
    ] * 2
    for span in spans:
        assert span.parent is not None and span.parent.span_id == span_id
        assert span.context.trace_id == trace_id and not span.links
    outcomes = [
        s.attributes.get("saga.step.outcome") or s.attributes.get("saga.compensation.outcome")
        for s in spans
    ]
    assert outcomes == ["succeeded", "done", "retried", "failed"]
    assert spans[3].status.status_code is trace.StatusCode.ERROR
    assert spans[2].status.status_code is trace.StatusCode.UNSET  # a retry is no error


def test_under_another_span_a_step_is_its_child_linked_to_the_run(
    exported: InMemorySpanExporter,
) -> None:
    outer = trace.get_tracer_provider().get_tracer("celery")
    with outer.start_as_current_span("run/tools.do_it") as celery_span:
        deliver({"ok": 1}, run_id="r-2", step=1)
    step = exported.get_finished_spans()[0]
    assert step.parent is not None
    assert step.parent.span_id == celery_span.get_span_context().span_id
    assert [link.context.span_id for link in step.links] == [tracing.run_ids("r-2")[1]]


def test_the_run_span_is_the_root_every_other_span_points_at(
    exported: InMemorySpanExporter,
) -> None:
    picture = RunPicture("r-3", RunState.COMPENSATED, "failed", None, [], [], [], 100.0, 102.5)
    telemetry.run_ended(picture)

    [span] = exported.get_finished_spans()
    assert (span.context.trace_id, span.context.span_id) == tracing.run_ids("r-3")
    assert span.parent is None and (span.start_time, span.end_time) == (100 * 10**9, 1025 * 10**8)
    assert span.attributes is not None and span.attributes["saga.state"] == "compensated"
