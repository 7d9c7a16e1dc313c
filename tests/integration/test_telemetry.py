"""Spans and metrics from a real worker: OpenTelemetry's SDK exports each span to a file the
test reads (``telemetry_setup``), with Celery's own instrumentation on; the metrics come from
the worker's ``--metrics-port``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga import RunState
from saga.client import Client
from saga.telemetry.tracing import run_ids
from saga.testing import free_port
from saga.testing.fake_models import FakeModel
from tasks import systems
from tests.integration.deployment import Deployment, deployment
from tests.integration.helpers import demo_steps, wait_until
from tests.integration.test_metrics import scrape, value

pytestmark = pytest.mark.timeout(180)
MODEL_SCRIPT = [("issue_credit", {"order_id": 4921, "amount_cents": 500, "memo": "m"}), "Done."]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, int, Path]]:
    spans = tmp_path_factory.mktemp("spans")
    port = free_port()
    model = FakeModel(MODEL_SCRIPT)
    with model.serve() as url:
        env = {
            "SAGA_TEST_SPANS": str(spans),
            "SAGA_TEST_CELERY_TRACING": "1",
            **model.environ(url),
        }
        args = ["--include", "tests.integration.telemetry_setup", "-Q", "celery,saga.turns"]
        with deployment(spans, env, [*args, "--metrics-port", str(port)]) as made:
            yield made, port, spans


def read_spans(directory: Path) -> list[dict[str, Any]]:
    lines = [f.read_text().splitlines() for f in directory.glob("spans-*.jsonl")]
    return [json.loads(line) for written in lines for line in written if line]


def spans_of(directory: Path, run_id: str, count: int) -> list[dict[str, Any]]:
    """The spans of ``run_id`` once at least ``count`` of them are written."""

    def enough() -> list[dict[str, Any]] | None:
        mine = [s for s in read_spans(directory) if s["attributes"].get("saga.run_id") == run_id]
        return mine if len(mine) >= count else None

    return wait_until(enough, 30, f"{count} spans of run {run_id}")


def hex_ids(run_id: str) -> tuple[str, str]:
    trace_id, span_id = run_ids(run_id)
    return f"0x{trace_id:032x}", f"0x{span_id:016x}"


def test_a_run_is_one_root_span_with_its_steps_and_compensations(
    traced: tuple[Deployment, int, Path],
) -> None:
    made, port, directory = traced
    before = scrape(port)
    # Given a run whose reply fails: credit and ticket succeed, then it unwinds
    systems.reset()
    systems.set_down("mail")
    run = made.saga.start_run()
    demo_steps(run)
    assert run.wait(timeout=60).state is RunState.COMPENSATED
    systems.clear_switches()

    # Then the run's span is a root with the ids derived from its id
    spans = spans_of(directory, run.run_id, 9)
    trace_id, span_id = hex_ids(run.run_id)
    [root] = [s for s in spans if s["name"] == "saga.run"]
    assert (root["context"]["trace_id"], root["context"]["span_id"]) == (trace_id, span_id)
    assert root["parent_id"] is None and root["attributes"]["saga.state"] == "compensated"

    # and every step and compensation is a child of Celery's task span, linked to the run
    by_id = {s["context"]["span_id"]: s for s in read_spans(directory)}
    steps = [s for s in spans if s["name"].startswith(("saga.step", "saga.compensation"))]
    outcomes = sorted(
        (
            s["attributes"]["saga.tool"],
            s["attributes"].get("saga.step.outcome")
            or s["attributes"]["saga.compensation.outcome"],
        )
        for s in steps
    )
    assert outcomes == [
        ("get_order", "succeeded"),
        ("issue_credit", "succeeded"),
        ("reverse_credit", "done"),
        ("send_reply", "failed"),
        ("send_reply", "retried"),
        ("send_reply", "retried"),
        ("set_ticket_status", "done"),
        ("set_ticket_status", "succeeded"),
    ]
    for span in steps:
        parent = by_id[span["parent_id"]]
        assert parent["name"].startswith("run/tools."), parent["name"]
        assert [link["context"]["span_id"] for link in span["links"]] == [span_id]
    credit = next(s for s in steps if s["attributes"]["saga.tool"] == "issue_credit")
    assert credit["attributes"]["saga.tool_class"] == 4
    failed = next(s for s in steps if s["attributes"].get("saga.step.outcome") == "failed")
    assert failed["status"]["status_code"] == "ERROR"

    # and the worker's metrics timed each delivery by tool and outcome
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("saga_step_duration_seconds_count", tool="send_reply", outcome="retried") == 2
    assert delta("saga_step_duration_seconds_count", tool="issue_credit", outcome="succeeded") == 1
    count = "saga_compensation_duration_seconds_count"
    assert delta(count, tool="reverse_credit", outcome="done") == 1


def test_a_hosted_turn_holds_its_model_call_with_the_model_and_its_tokens(
    traced: tuple[Deployment, int, Path],
) -> None:
    made, port, directory = traced
    before = scrape(port)
    systems.reset()
    client = Client()
    # When a hosted run of the traced agent asks the (fake) model twice
    run_id = client.enqueue_run("traced", "Order 4921 arrived late.")
    assert made.saga.run(run_id).wait(timeout=60).state is RunState.COMPLETED
    client.store.client.close()

    # Then each model call is a child of its turn, with the model and the tokens
    spans = spans_of(directory, run_id, 6)
    turns = {s["context"]["span_id"]: s for s in spans if s["name"] == "saga.turn"}
    calls = [s for s in spans if s["name"] == "chat gpt-4o-mini"]
    assert len(turns) == 2 and len(calls) == 2
    for call in calls:
        assert call["parent_id"] in turns
        attributes = call["attributes"]
        assert attributes["gen_ai.request.model"] == "gpt-4o-mini"
        assert attributes["gen_ai.system"] == "openai"
        assert (
            attributes["gen_ai.usage.input_tokens"],
            attributes["gen_ai.usage.output_tokens"],
        ) == (12, 7)
        assert attributes["saga.agent"] == "traced"
    assert sorted(t["attributes"]["saga.turn"] for t in turns.values()) == [1, 2]

    # and the metrics counted the calls, the tokens and the turns
    def moved() -> dict[Any, float] | None:
        now = scrape(port)
        return (
            now
            if value(now, "saga_runs_ended_total", state="completed")
            > value(before, "saga_runs_ended_total", state="completed")
            else None
        )

    after = wait_until(moved, 30, "the run's end to be counted")
    labels = {"agent": "traced", "model": "gpt-4o-mini"}

    def delta(name: str, **more: str) -> float:
        return value(after, name, **labels, **more) - value(before, name, **labels, **more)

    assert delta("saga_model_calls_total", outcome="answered") == 2
    assert delta("saga_model_tokens_total", direction="in") == 24
    assert delta("saga_model_tokens_total", direction="out") == 14
    assert delta("saga_model_call_duration_seconds_count") == 2
    played = value(after, "saga_turns_total", outcome="played")
    assert played - value(before, "saga_turns_total", outcome="played") == 2
