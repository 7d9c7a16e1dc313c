"""The app both workers of ``benchmarks/agents.py`` run (``celery -A benchmarks.agents_app``):
two trivial tools, a fake model, and the ``bench`` agent that plays it.

The tools do next to nothing on purpose: what is measured is the loop around them (turns,
dispatch, the undo pushes, the wake-ups), not a system they would call. One is a read, the
other a compensatable write, so each turn pushes an undo like a real agent's would.

The fake model sleeps ``SAGA_BENCH_MODEL_SECONDS`` (0.5 s) per call, as a provider keeps a
request open, and counts the calls in flight in Redis: it runs in the turn worker's threads,
so only a shared counter can tell how many overlapped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery

from saga import Saga, StepContext, ToolClass, ToolRegistry, Undo
from saga.agents import Limits, ModelTurn, ToolCall, Transcript
from saga.agents.hosted import turn_task_options
from saga.tools import Tool

__all__ = [
    "AGENT",
    "CALLS",
    "IN_FLIGHT_KEY",
    "NOOP_TURN",
    "PEAK_KEY",
    "TURNS",
    "app",
    "model_wait",
    "saga",
]

AGENT = "bench"
#: Turns with calls before the final answer, and the calls of each.
TURNS = 3
CALLS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("look_up", {"order_id": 4921}),
    ("hold_funds", {"order_id": 4921, "amount_cents": 100}),
)
IN_FLIGHT_KEY = "bench:model:in-flight"
PEAK_KEY = "bench:model:peak"
MODEL_SECONDS = float(os.environ.get("SAGA_BENCH_MODEL_SECONDS", "0.5"))

# INCR and the high-water mark in one step, so two threads cannot both miss the peak.
_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""

tools = ToolRegistry()


@tools.tool(ToolClass.READ)
def look_up(order_id: int) -> dict[str, Any]:
    """A read: no undo."""
    return {"order_id": order_id, "total_cents": 4999}


def _release(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo("release_funds", {"hold_id": result["hold_id"]}, "release the hold")


@tools.tool(ToolClass.COMPENSATABLE_WRITE, compensation=_release)
def hold_funds(ctx: StepContext, order_id: int, amount_cents: int) -> dict[str, Any]:
    """A write whose undo is pushed (and, since every run completes, never run)."""
    return {"hold_id": ctx.idempotency_key, "amount_cents": amount_cents}


@tools.compensation()
def release_funds(ctx: StepContext, hold_id: str) -> dict[str, Any]:
    return {"released": hold_id}


app = Celery("saga-bench-agents")
app.config_from_object("saga.celery_defaults")
saga = Saga(app, tools)

_client: redis.Redis | None = None
_client_lock = threading.Lock()


def _redis() -> redis.Redis:
    """One client (a thread-safe pool) per process, made on first use: on a plain Redis named
    by ``SAGA_BENCH_COUNTER_URL`` when set (``benchmarks/shards.py`` keeps the counter off the
    store it meters, which may be a cluster), else on the store's."""
    global _client
    with _client_lock:
        if _client is None:
            url = os.environ.get("SAGA_BENCH_COUNTER_URL") or os.environ["SAGA_REDIS_URL"]
            _client = redis.Redis.from_url(url)
        return _client


@contextmanager
def _counted() -> Iterator[None]:
    client = _redis()
    client.eval(_ENTER, 2, IN_FLIGHT_KEY, PEAK_KEY)
    try:
        yield
    finally:
        client.decr(IN_FLIGHT_KEY)


def model_wait() -> None:
    """What a model call costs the caller: a request held open, counted while it is."""
    with _counted():
        time.sleep(MODEL_SECONDS)


def fake_model(transcript: Transcript, offered: Sequence[Tool]) -> ModelTurn:
    """Two calls per turn for ``TURNS`` turns, then the final answer; ids stable on replay."""
    model_wait()
    k = len(transcript.turns)
    if k >= TURNS:
        return ModelTurn(text="Done.", stop_reason="end_turn")
    calls = tuple(
        ToolCall(f"call_{k}_{i}", name, dict(args)) for i, (name, args) in enumerate(CALLS)
    )
    return ModelTurn(calls=calls, stop_reason="tool_use")


saga.agent(
    AGENT,
    fake_model,
    tools=[name for name, _ in CALLS],
    limits=Limits(max_turns=TURNS + 1, max_tool_calls=TURNS * len(CALLS)),
)


#: A turn that does nothing, on the turns queue with a turn's task options: what Celery alone
#: costs per turn message (send, receive, ack), which no change to the loop can save.
NOOP_TURN = "bench.noop_turn"


@app.task(name=NOOP_TURN, **turn_task_options(saga))
def noop_turn(self: Any, run_id: str, turn: int) -> None:
    return None
