"""The engine driven by hand: real Redis, real scripts, the real worker functions, and a broker
the test holds, so a test can place an actor (a reaper pass, a revoke, a lost reply) at the
exact point of an interleaving.

Messages are captured where every publish ends (``app.send_task``: a dispatch, a chain, a
retry) and delivered by calling the worker's own functions with a small stand-in for the Celery
task; a delivery that returns passes its chain on, as Celery's tracer does.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from celery.exceptions import Ignore

from saga import RetryPolicy, Saga, Settings, StepContext, ToolClass, ToolRegistry, Undo
from saga.compensation import compensate
from saga.constants import CONCLUDE_UNWIND_TASK, run_keys
from saga.forward import run_step
from saga.redis_urls import redis_client
from tests.conftest import TEST_DB, redis_url_with_db

# Below the session's database (TEST_DB); test_operations and test_listing take the two above.
HARNESS_DB = int(os.environ.get("SAGA_TEST_HARNESS_REDIS_DB", str(TEST_DB - 1)))

TIME_LIMIT = 30


@dataclass
class Message:
    name: str
    kwargs: dict[str, Any]
    task_id: str
    chain: list[Any] = field(default_factory=list)


class Retried(Exception):
    """What the stand-in's ``retry()`` returns for the task to raise."""


@dataclass
class _Request:
    id: str
    chain: list[Any] | None
    root_id: str | None = None
    retries: int = 0


class FakeTask:
    """Enough of a bound Celery task for the worker functions: its request, retry, app."""

    def __init__(self, harness: Harness, message: Message) -> None:
        self.app = harness.saga.app
        self.request = _Request(message.task_id, list(message.chain) or None)
        self._harness, self._message = harness, message

    def retry(self, exc: BaseException | None = None, countdown: float | None = None) -> Retried:
        chain = list(self.request.chain or [])
        self._harness.queue.append(
            Message(self._message.name, self._message.kwargs, self._message.task_id, chain)
        )
        return Retried(str(exc))


@dataclass
class World:
    """The external systems: effects by idempotency key, and every undo applied, in order."""

    credits: dict[str, int] = field(default_factory=dict)
    reversals: list[str] = field(default_factory=list)
    failing_reversals: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)
    holds: dict[str, str] = field(default_factory=dict)  # held stock by key: its sku
    releases: list[str] = field(default_factory=list)
    failing_holds: int = 0  # the stock system's next N calls fail (before any effect)


class Harness:
    """A Saga on the test's Redis with the demo-like tools below and a captured broker."""

    def __init__(self, redis_url: str, data: Path, **settings: Any) -> None:
        self.world = World()
        self.queue: list[Message] = []
        self.registry = _registry(self.world)
        app = Celery("harness", broker=redis_url)
        app.conf.update(
            task_serializer="json",
            accept_content=["json"],
            task_acks_late=True,
            task_time_limit=TIME_LIMIT,
        )
        options = {
            "retention_seconds": 600,
            "run_deadline_seconds": 60,
            "store_outage_patience": 2.0,
            **settings,
        }
        self.saga = Saga(
            app,
            self.registry,
            settings=Settings(
                redis_url=redis_url, database_url=f"sqlite:///{data / 'records.db'}", **options
            ),
        )
        self.send_error: Callable[[Message], None] | None = None
        app.send_task = self._send  # type: ignore[method-assign]
        self.run_ids: list[str] = []

    def _send(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> None:
        message = Message(
            name,
            dict(kwargs or {}),
            str(options.get("task_id") or uuid.uuid4()),
            list(options.get("chain") or []),
        )
        self.queue.append(message)
        if self.send_error is not None:
            self.send_error(message)

    def start(self, **options: Any) -> str:
        run_id = self.saga.start_run(**options).run_id
        self.run_ids.append(run_id)
        return run_id

    def take(self, name: str | None = None, **match: Any) -> Message:
        """Remove the first queued message with this task name and these kwargs."""
        for message in self.queue:
            if (name is None or message.name == name) and all(
                message.kwargs.get(k) == v for k, v in match.items()
            ):
                self.queue.remove(message)
                return message
        raise AssertionError(f"no message {name} {match} in {self.queue}")

    def deliver(self, message: Message) -> Any:
        """Run one delivery as a worker would; exceptions are the task's outcome."""
        if message.name == CONCLUDE_UNWIND_TASK:
            return self.saga.core.conclude(
                message.kwargs["run_id"], message.kwargs.get("owner", "")
            )
        tool = self.registry.get(message.name.removeprefix("tools."))
        task = FakeTask(self, message)
        kwargs = message.kwargs
        try:
            if kwargs.get("compensates") is not None:
                result = compensate(
                    self.saga.core,
                    task,
                    tool,
                    kwargs["run_id"],
                    int(kwargs["compensates"]),
                    kwargs.get("unwind", ""),
                )
            else:
                result = run_step(
                    self.saga.core,
                    task,
                    tool,
                    kwargs["run_id"],
                    int(kwargs["step"]),
                    kwargs.get("args") or {},
                )
        except (Retried, Ignore) as exc:
            return exc
        except Exception as exc:
            return exc
        if task.request.chain:  # Celery's tracer sends the next task with the rest
            rest = list(task.request.chain)
            following = rest.pop()
            self.queue.append(
                Message(
                    following["task"],
                    dict(following["kwargs"]),
                    following["options"].get("task_id") or str(uuid.uuid4()),
                    rest,
                )
            )
        return result

    def drain(self, limit: int = 200) -> None:
        """Deliver everything queued (and what that sends) until the broker is empty."""
        for _ in range(limit):
            if not self.queue:
                return
            self.deliver(self.queue.pop(0))
        raise AssertionError(f"still delivering after {limit} messages: {self.queue[:3]}")

    def close(self) -> None:
        client = self.saga.store.client
        for run_id in self.run_ids:
            client.delete(*run_keys(run_id))
            client.zrem(self.saga.store.layout.active_of(run_id), run_id)
        client.close()
        if self.saga.core._records is not None:
            self.saga.records.dispose()


def harness(redis_url: str, data: Path, **settings: Any) -> Iterator[Harness]:
    """A harness on a Redis database of its own, empty at the start.

    The reaper passes in these tests scan every open run of their database: runs that the
    session's real workers left behind (a hosted run idling at a turn, say) would be revived into
    this harness's fake broker, which knows only the tools it registered.
    """
    url = redis_url_with_db(redis_url, HARNESS_DB)
    redis_client(url).flushdb()
    made = Harness(url, data, **settings)
    yield made
    made.close()
    redis_client(url).flushdb()


def _registry(world: World) -> ToolRegistry:
    tools = ToolRegistry()

    def lookup_credit(key: str, args: dict[str, Any]) -> dict[str, Any] | None:
        return {"credit_id": key} if key in world.credits else None

    @tools.tool(
        ToolClass.COMPENSATABLE_WRITE,
        compensation=lambda args, result: Undo(
            "reverse_credit", {"credit_id": result["credit_id"]}
        ),
        lookup=lookup_credit,
    )
    def issue_credit(ctx: StepContext, amount: int) -> dict[str, Any]:
        """Issue a credit (idempotent by key)."""
        world.calls.append(("issue_credit", ctx.attempt))
        world.credits.setdefault(ctx.idempotency_key, amount)
        return {"credit_id": ctx.idempotency_key}

    @tools.compensation()
    def reverse_credit(ctx: StepContext, credit_id: str) -> dict[str, Any]:
        world.calls.append(("reverse_credit", ctx.attempt))
        if world.failing_reversals > 0:
            world.failing_reversals -= 1
            raise RuntimeError("billing 503")
        if ctx.idempotency_key not in world.reversals:
            world.reversals.append(ctx.idempotency_key)
        return {"reversed": credit_id}

    @tools.tool(
        ToolClass.REVERSIBLE_WRITE,
        compensation=lambda args, result: Undo("release_stock", {"hold_id": result["hold_id"]}),
        retry=RetryPolicy(attempts=2),
    )
    def hold_stock(ctx: StepContext, sku: str) -> dict[str, Any]:
        """Hold stock (idempotent by key; no lookup)."""
        world.calls.append(("hold_stock", ctx.attempt))
        if world.failing_holds > 0:
            world.failing_holds -= 1
            raise RuntimeError("stock service 503")
        world.holds.setdefault(ctx.idempotency_key, sku)
        return {"hold_id": ctx.idempotency_key}

    @tools.compensation()
    def release_stock(ctx: StepContext, hold_id: str) -> dict[str, Any]:
        world.holds.pop(hold_id, None)
        world.releases.append(hold_id)
        return {"released": hold_id}

    @tools.tool(ToolClass.IRREVERSIBLE_WRITE)
    def send_mail(ctx: StepContext, to: str) -> dict[str, Any]:
        """Send an e-mail."""
        return {"sent": to}

    return tools
