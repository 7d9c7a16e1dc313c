"""Traces and timings of what the workers do: the hooks ``saga.worker``, ``saga.agents.hosted``
and ``saga.engine`` call, one line each.

Each hook times its work for the Prometheus histograms (``saga.metrics``) and, when tracing is
on, makes its span (``saga.telemetry.tracing``: how a run's spans join up across processes,
and with Celery's own instrumentation). Neither may fail the work it watches: every failure
here is logged once and swallowed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from saga import metrics
from saga.agents.agent import Agent
from saga.agents.messages import ModelTurn
from saga.errors import StepInDoubtError
from saga.picture import RunPicture
from saga.telemetry import tracing
from saga.tools import Tool

logger = logging.getLogger("saga.telemetry")
_PROVIDERS = {"openai_chat": "openai", "openai_responses": "openai", "anthropic": "anthropic"}
_failed_once = False


_celery_signals: tuple[type[BaseException], type[BaseException]] | None = None


def _outcome(exc: BaseException | None, result: Any, kind: str) -> str:
    """The words ``saga.metrics`` counts deliveries by."""
    global _celery_signals
    if exc is not None:
        if _celery_signals is None:  # only ever asked inside a Celery task
            # Imported on use: only the path that needs it loads it.
            from celery.exceptions import Ignore, Retry

            _celery_signals = (Retry, Ignore)
        if isinstance(exc, _celery_signals[0]):
            return "retried"
        if isinstance(exc, _celery_signals[1]):
            return "ignored"
        return "in_doubt" if isinstance(exc, StepInDoubtError) else "failed"
    if kind == "turn":
        return "played"
    if kind == "compensation":
        return "replayed" if isinstance(result, dict) and result.get("replayed") else "done"
    return "rejected" if isinstance(result, dict) and list(result) == ["rejected"] else "succeeded"


def _span(name: str, run_id: str, attributes: dict[str, Any]) -> Any:
    """The span as a context manager (yielding None when tracing is off, or failed)."""
    global _failed_once
    try:
        found = tracing.tracer()
        if found is not None:
            attributes = {k: v for k, v in attributes.items() if v is not None}
            return tracing.start(found, name, run_id, {"saga.run_id": run_id, **attributes})
    except Exception:
        if not _failed_once:
            _failed_once = True
            logger.exception("saga tracing could not start a span")
    return contextlib.nullcontext()


def _finish(span: Any, outcome: str, exc: BaseException | None, **attributes: Any) -> None:
    if span is None:
        return
    try:
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
        if outcome in ("failed", "in_doubt") and exc is not None:
            tracing.failed(span, exc)
    except Exception:
        logger.debug("saga tracing could not finish a span", exc_info=True)


def _deliver(
    kind: str, name: str, run_id: str, attributes: dict[str, Any], task: Callable[[], Any]
) -> Any:
    """Run one delivery of a task, timed and traced; its outcome from what it returned or
    raised. (Plain try/finally: with tracing off this is the whole cost, on every task.)"""
    began = time.perf_counter()
    with _span(name, run_id, attributes) as span:
        exc: BaseException | None = None
        result: Any = None
        try:
            result = task()
            return result
        except BaseException as raised:
            exc = raised
            raise
        finally:
            outcome = _outcome(exc, result, kind)
            if span is not None:
                _finish(span, outcome, exc, **{f"saga.{kind}.outcome": outcome})
            if kind == "turn":
                metrics.turn(outcome)
            else:
                seconds = time.perf_counter() - began
                metrics.task_duration(kind, name.rpartition(" ")[2], outcome, seconds)


def traced_tool(tool: Tool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a tool's task: each delivery, a step or a compensation, is timed by outcome
    and traced (``saga.step <tool>`` / ``saga.compensation <tool>``)."""
    klass = None if tool.tool_class is None else int(tool.tool_class)

    def decorate(task: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(task)
        def run_tool(
            self: Any,
            run_id: str,
            step: int | None = None,
            args: dict[str, Any] | None = None,
            compensates: int | None = None,
            unwind: str = "",
        ) -> Any:
            kind = "step" if compensates is None else "compensation"
            attributes = {
                "saga.step": step if compensates is None else compensates,
                "saga.tool": tool.name,
                "saga.tool_class": klass,
            }
            call = functools.partial(task, self, run_id, step, args, compensates, unwind)
            return _deliver(kind, f"saga.{kind} {tool.name}", run_id, attributes, call)

        return run_tool

    return decorate


def traced_turn(task: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates ``saga.agent_turn``: each delivery of a turn, traced (``saga.turn``, the
    parent of its model call) and counted by outcome."""

    @functools.wraps(task)
    def agent_turn(self: Any, run_id: str, turn: int, attempt: int = 1) -> Any:
        delivery = int(getattr(self.request, "retries", 0) or 0) + 1
        attributes = {"saga.turn": int(turn), "saga.attempt": delivery}
        call = functools.partial(task, self, run_id, turn, attempt)
        return _deliver("turn", "saga.turn", run_id, attributes, call)

    return agent_turn


def model_call(
    run_id: str, number: int, agent: Agent, ask: Callable[..., ModelTurn], *args: Any
) -> ModelTurn:
    """``ask(*args)``: the model asked once, timed and traced with the model and the tokens."""
    policy = agent.policy
    model = str(getattr(policy, "model", None) or type(policy).__name__)
    fmt = getattr(getattr(policy, "format", None), "format", None)
    provider = _PROVIDERS.get(str(getattr(fmt, "value", "")), "none")
    attributes = {
        "saga.run_id": run_id,
        "saga.turn": number,
        "saga.agent": agent.name,
        "gen_ai.operation.name": "chat",
        "gen_ai.system": provider,
        "gen_ai.request.model": model,
    }
    began = time.perf_counter()
    with _span(f"chat {model}", run_id, attributes) as span:
        try:
            answer = ask(*args)
        except BaseException as exc:
            _finish(span, "failed", exc)
            metrics.model_call(agent.name, model, "failed", time.perf_counter() - began)
            raise
        usage = answer.usage
        _finish(
            span,
            "answered",
            None,
            **{
                "gen_ai.usage.input_tokens": usage.input_tokens,
                "gen_ai.usage.output_tokens": usage.output_tokens,
                "gen_ai.response.finish_reasons": [answer.stop_reason or ""],
                "saga.tool_calls": len(answer.calls),
            },
        )
        metrics.model_call(agent.name, model, "answered", time.perf_counter() - began)
        metrics.tokens(agent.name, model, usage.input_tokens, usage.output_tokens)
        return answer


def run_ended(picture: RunPicture) -> None:
    """The run is recorded: emit its span, the root its other spans point at."""
    try:
        found = tracing.tracer()
        if found is None:
            return
        attributes = {
            "saga.run_id": picture.run_id,
            "saga.state": picture.state.value,
            "saga.reason": picture.reason,
            "saga.steps": len(picture.steps),
        }
        if picture.pivot_step is not None:
            attributes["saga.pivot_step"] = picture.pivot_step
        end = picture.ended if picture.ended is not None else picture.updated
        tracing.emit_run(found, picture.run_id, picture.created, end, attributes)
    except Exception:
        logger.debug("saga tracing could not emit the run's span", exc_info=True)
