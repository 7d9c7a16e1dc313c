"""Imported by a test worker (``--include``): OpenTelemetry's SDK writing every span, as JSON
lines, to a file per process in ``SAGA_TEST_SPANS``, Celery's own instrumentation on, and an
agent whose model (the fake one the test serves) speaks OpenAI Chat."""

from __future__ import annotations

import os
from typing import IO, Any

from openai import OpenAI
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from saga.agents import ChatModelPolicy
from tasks.app import saga


class _PerProcess:
    """A file per process (prefork children included), opened on first write."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files: dict[int, IO[str]] = {}

    def write(self, text: str) -> Any:
        pid = os.getpid()
        if pid not in self.files:
            self.files[pid] = open(f"{self.directory}/spans-{pid}.jsonl", "a")  # noqa: SIM115
        return self.files[pid].write(text)

    def flush(self) -> None:
        self.files[os.getpid()].flush()


def _line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


provider = TracerProvider()
exporter = ConsoleSpanExporter(out=_PerProcess(os.environ["SAGA_TEST_SPANS"]), formatter=_line)
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
if os.environ.get("SAGA_TEST_CELERY_TRACING") == "1":
    CeleryInstrumentor().instrument(tracer_provider=provider)

saga.agent(
    "traced",
    ChatModelPolicy(OpenAI(max_retries=0), "gpt-4o-mini", "openai_chat"),
    tools=["get_order", "issue_credit"],
)
