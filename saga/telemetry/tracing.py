"""OpenTelemetry spans (``pip install 'saga-compensation[otel]'``): run → step / compensation, and
run → turn → model call.

A run spans many processes and messages, and may be resumed days later by the reaper or a
requeue, so no process can hold its span open. Its trace context is therefore derived from the
run id (``run_context``): every process computes the same trace id and the same span id for
the run, with nothing to store or carry. The run's own span is emitted once, when the run is
recorded, with exactly that context and its real start and end times; it is the trace's root.

Where Celery's instrumentation (``opentelemetry-instrumentation-celery``) is on, a task runs
inside Celery's span, which continues whoever sent the message (the web request that called
``run.call``, the turn that dispatched the step, the compensation before in the chain): a
step's span is then that span's child, so the causal chain of messages stays intact, and it
carries a link to the run's span instead. Without it, a step's span is a child of the run's.

Tracing is off, and costs one check per hook, unless opentelemetry is installed and a tracer
provider other than the API's default no-op is set (``OTEL_SDK_DISABLED=true`` turns it off).
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Any

#: What ``tracer()`` found, per provider: (provider, tracer or None).
_cache: list[Any] = [None, None]
#: Ids the next span started by saga's tracer must take (the run's own span).
_forced: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "saga_forced_span_ids", default=None
)
_missing = False


def api() -> Any:
    """``opentelemetry.trace``, or None when it is not installed (imported on first use)."""
    global _missing
    if _missing:
        return None
    try:
        # An optional extra: imported where it is used.
        from opentelemetry import trace
    except ImportError:
        _missing = True
        return None
    return trace


def tracer() -> Any:
    """saga's tracer, or None when tracing is off."""
    trace = api()
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if _cache[0] is provider:
        return _cache[1]
    found = None
    if not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        found = provider.get_tracer("saga")
        if isinstance(found, trace.NoOpTracer):
            found = None
        elif hasattr(found, "id_generator"):  # the SDK's: let the run's span take its ids
            found.id_generator = _RunIds(found.id_generator)
    _cache[:] = [provider, found]
    return found


class _RunIds:
    """The SDK tracer's id generator, except for the run's span, whose ids come from its id."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced else int(self.inner.generate_trace_id())

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced else int(self.inner.generate_span_id())

    def is_trace_id_random(self) -> bool:
        """A derived trace id is not random (the SDK flags random ones for W3C level 2)."""
        inner = getattr(self.inner, "is_trace_id_random", None)
        return _forced.get() is None and bool(inner and inner())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_ids(run_id: str) -> tuple[int, int]:
    """The run's trace id and span id: the same in every process, never zero."""
    digest = hashlib.sha256(f"saga-run:{run_id}".encode()).digest()
    return int.from_bytes(digest[:16]) or 1, int.from_bytes(digest[16:24]) or 1


def run_context(run_id: str) -> Any:
    """The run's span context, as a remote parent (sampled)."""
    trace = api()
    trace_id, span_id = run_ids(run_id)
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
    return trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags)


def start(found: Any, name: str, run_id: str, attributes: dict[str, Any]) -> Any:
    """A span as current: a child of the current span (Celery's) linked to the run, or, with
    no current span, a child of the run's span."""
    trace = api()
    run = run_context(run_id)
    if trace.get_current_span().get_span_context().is_valid:
        parent, links = None, [trace.Link(run)]
    else:
        parent, links = trace.set_span_in_context(trace.NonRecordingSpan(run)), []
    return found.start_as_current_span(
        name,
        context=parent,
        links=links,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )


def failed(span: Any, exc: BaseException) -> None:
    trace = api()
    span.record_exception(exc)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def emit_run(found: Any, run_id: str, start_s: float, end_s: float, attrs: dict[str, Any]) -> None:
    """The run's own span, with the ids every other span of the run points at."""
    # An optional extra: imported where it is used.
    from opentelemetry.context import Context

    context = Context()  # a root: the trace is the run's
    if not isinstance(found.id_generator if hasattr(found, "id_generator") else None, _RunIds):
        # Not the SDK's tracer: its ids cannot be chosen; stay in the run's trace at least.
        context = api().set_span_in_context(api().NonRecordingSpan(run_context(run_id)))
    token = _forced.set(run_ids(run_id))
    try:
        span = found.start_span(
            "saga.run", context=context, start_time=int(start_s * 1e9), attributes=attrs
        )
    finally:
        _forced.reset(token)
    span.end(end_time=int(end_s * 1e9))
