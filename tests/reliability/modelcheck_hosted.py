"""A Hypothesis stateful model check of the hosted agent loop (``saga.agents.hosted``), the
sibling of ``tests.reliability.modelcheck`` (the engine's): the same broker the model owns,
the same gated deliveries, world ledger, campaign, resources and CLI, imported from there.

    python -m tests.reliability.modelcheck_hosted --examples 2000 --seed 1 [--jobs 2]

What it adds: each run is a hosted run (``Saga.enqueue_run``), its turns are messages on the
model's broker, and a delivery of a turn runs the real ``play_turn`` in a thread. The model is
a scripted fake whose every call blocks at a gate: each example draws a script (what turn k
answers when nothing else is said: ``settle`` and the end of the example follow it), and
``answer_model`` makes a blocked call answer anything (a final answer, one call or several, a
call that needs a person's approval, malformed calls: no id, a duplicate id, an unknown tool,
oversized arguments); ``model_fails`` makes it fail (a 429) or kills its worker. Every model
call is logged with the delivery that made it.

Rules beyond the engine check's (tool deliveries, broker redelivery/duplicates/revokes, reaper
passes, paused reaper passes, lost replies, refused publishes, records outages): the model
answers or fails or the asker dies; the worker dies at a point of ``run_turn`` (after the
answer is recorded, between two dispatches, between marking the loop ended and carrying the
end out); ``enqueue_run`` again with the same id (the library's and the web client's); a
person approves (or approves other arguments, or approves twice) or denies a pending call;
``abort_run``; the reply of a named script of the loop is lost (``lose_reply_of``: the
ask, the answer, the lease, the advance, a refusal, the frozen results, an approval's request,
decision or expiry, a revival, the abort, the conclusion); time passes past the asking
lease (a model call that outlasts it: the keeper renews the leases of live calls, if the code
has one; a dead asker's lease runs out). A reaper pass past the run's deadline is that much
time passing too: approval requests age.

Invariants, after every step (from the model-call log, the world ledger, Redis and SQL):
``model-asked-concurrently`` (two deliveries in the model for one turn at once),
``model-asked-after-answer`` (the model asked for a turn whose answer is recorded),
``refusal-not-fed-back`` (a refused, denied or expired call of an earlier turn is not an error
result in the transcript the model reads), ``approval-accepted-*`` (a decision on other
arguments, or a second decision, taken); at the end of an example: ``final-answer-unwound``
(the loop ended on a final answer while the run was running, and the run did not complete
although nobody aborted it),
``abandoned-without-loss`` (the reaper aborted the run as abandoned though none of its messages
was lost and none sat waiting when it looked), ``call-two-steps``, ``irreversible-without-
approval`` (a send went out without an approval of exactly its arguments),
``loop-failed-in-the-library`` (the loop ended "the policy failed", which the scripted model
never does: the library raised around it), and the engine check's own (``stuck-<state>``,
``sql-disagrees``, the world's symptoms, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import sys
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from kombu.exceptions import OperationalError as BrokerError

from saga import RetryPolicy, SagaError
from saga.agents import hosted as hosted_module
from saga.agents.agent import Limits
from saga.agents.messages import ModelTurn, ToolCall
from saga.agents.turn_state import TurnStore, args_hash
from saga.client import Client
from saga.constants import AGENT_TURN_TASK, START_UNWIND_TASK, agent_key
from saga.errors import ModelCallError
from tests.reliability import modelcheck as mc
from tests.reliability.modelcheck import (
    WORLD,
    Command,
    Delivery,
    FakeTask,
    Finding,
    Message,
    MessageInfo,
    ModelCheck,
    Published,
    WorkerCrash,
    current_delivery,
    first_line,
    step,
)

# =============================================================================================
# Adapter: every touch-point on the hosted loop (the engine's are in ``modelcheck.Engine``).
# Old code (before issue 15's fixes) is bridged here: no ``play_turn`` (``run_turn`` returns a
# delay), no lease keeper, no ``after_loop_ended`` fault point, no ``Client`` deadline.
# =============================================================================================

try:  # the lease keeper (renews the asking lease while the model call runs) is new
    from saga.agents.lease import keeper_for
except ImportError:  # pragma: no cover - old code
    keeper_for = None  # type: ignore[assignment]

try:  # the fence of an asker whose lease ran out (ask_model.lua) is newer still
    from saga.agents import hosted as _hosted_loop
    from saga.turn_scripts import AskerFence

    # The model moves time in whole leases (``lease_time_passes``), in which a live asker's
    # keeper renews: a dead asker's fence passes at once rather than in real seconds.
    _hosted_loop.ASKER_FENCE = AskerFence(seconds=0.001, gap_seconds=60.0)  # type: ignore[misc]
    _hosted_loop.FENCE_POLL = 0.002  # type: ignore[misc]
except ImportError:  # pragma: no cover - old code
    pass

AGENT = "checked"
#: The tool a person must approve (class 5).
APPROVED_TOOL = "send_mail"
#: Small, so oversized arguments are cheap to make.
MAX_PAYLOAD = 4096
#: Generous: the limits are not what this check is about (a refusal limit would end a run
#: of unanswered approvals before the reaper's revival limit could show).
LIMITS = Limits(max_turns=12, max_tool_calls=30, max_consecutive_refusals=12)
#: Model attempts: a 429 is retried this often.
MODEL_RETRY = RetryPolicy(attempts=3, backoff=0.0, jitter=False)
#: The asking lease, as the library takes it (at most), for "time passes past the lease".
TURN_LEASE = 60.0
#: Where ``run_turn`` may kill its worker (the ``saga.testing`` fault points of a turn).
TURN_POINTS = ("after_model_answer", "between_dispatches", "after_loop_ended")

#: The loop's own store scripts (and the ones it ends through): a lost reply of each is a rule.
LOOP_SCRIPTS = (
    "ask_model",
    "record_answer",
    "turn_lease",
    "advance_turn",
    "record_refusal",
    "freeze_results",
    "request_approval",
    "decide_approval",
    "expire_approval",
    "count_revival",
    "abort",
    "conclude",
)
#: What the scripted model may answer: kind -> the calls (tool, arguments, id) or a final text.
ANSWERS: dict[str, list[tuple[str, dict[str, Any], str | None]] | str] = {
    "final": "all done",
    "credit": [("issue_credit", {"amount": 25}, "c0")],
    "hold": [("hold_stock", {"sku": "sku-1"}, "c0")],
    "read": [("read_order", {"order_id": 7}, "c0")],
    "mail": [(APPROVED_TOOL, {"to": "a@example.com"}, "c0")],
    "read_and_flag": [("read_order", {"order_id": 7}, "c0"), ("set_flag", {"flag": "vip"}, "c1")],
    "two_writes": [("issue_credit", {"amount": 5}, "c0"), ("hold_stock", {"sku": "s"}, "c1")],
    "no_id": [("read_order", {"order_id": 1}, None), ("set_flag", {"flag": "x"}, "")],
    "duplicate_id": [
        ("read_order", {"order_id": 1}, "same"),
        ("read_order", {"order_id": 2}, "same"),
    ],
    "unknown_tool": [("launch_rockets", {"count": 3}, "c0")],
    "oversized": [("set_flag", {"flag": "x" * (MAX_PAYLOAD + 10)}, "c0")],
}


def model_answer(kind: str, turn: int) -> ModelTurn:
    """The scripted model's answer of ``kind`` (ids made unique per turn, except the faulty)."""
    spec = ANSWERS[kind]
    if isinstance(spec, str):
        return ModelTurn(text=spec, stop_reason="end_turn")
    calls = []
    for name, arguments, given in spec:
        call_id = given if given in (None, "", "same") else f"t{turn}_{given}"
        raw = {"name": name, "arguments": arguments}
        calls.append(ToolCall(call_id, name, dict(arguments), raw))  # type: ignore[arg-type]
    return ModelTurn(calls=tuple(calls), stop_reason="tool_use")


def retryable_model_error() -> Exception:
    return ModelCallError("429 too many requests (model)", retryable=True, status=429)


class Strikes:
    """``saga.faults`` for the model: a fault point of a turn kills its worker when armed."""

    def __init__(self, hooks: Any) -> None:
        self.hooks = hooks

    def strike(self, point: str, name: str) -> None:
        self.hooks.hook_strike(point)


def _bridge_after_loop_ended() -> None:
    """Old code has no fault point between marking the loop ended and carrying it out: put
    one right after ``mark_ended`` (where the new code strikes)."""
    if "after_loop_ended" in inspect.getsource(hosted_module):
        return
    original = TurnStore.mark_ended
    if getattr(original, "bridged", False):
        return

    def mark_ended(self: TurnStore, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        faults = getattr(_BRIDGE, "saga", None)
        if faults is not None and faults.faults is not None:
            faults.faults.strike("after_loop_ended", "")
        return result

    mark_ended.bridged = True  # type: ignore[attr-defined]
    TurnStore.mark_ended = mark_ended  # type: ignore[method-assign]


#: The saga whose faults the bridged fault point strikes (one engine per process).
_BRIDGE = SimpleNamespace(saga=None)


class HostedEngine(mc.Engine):
    """The engine, with a hosted agent whose policy is the model's, and a web client."""

    def settings_overrides(self) -> dict[str, Any]:
        # Patience well above one replay: a lost reply (the only outage here) is always
        # replayed by ``play_turn``, whatever the machine's load. At the engine check's
        # 0.05 s, a slow first attempt gave up instead, so one example could run two ways
        # (Hypothesis then stops: "inconsistent data generation").
        return {"max_payload_bytes": MAX_PAYLOAD, "store_outage_patience": 5.0}

    def __init__(self, redis_url: str, database_url: str, world: Any, hooks: Any) -> None:
        super().__init__(redis_url, database_url, world, hooks)
        saga = self.saga
        saga.agent(
            AGENT,
            self._policy,
            tools=list(mc.AGENT_CALLS),
            limits=LIMITS,
            model_retry=MODEL_RETRY,
            approval=[APPROVED_TOOL],
        )
        saga.faults = Strikes(hooks)  # type: ignore[assignment]
        _BRIDGE.saga = saga
        _bridge_after_loop_ended()
        if keeper_for is not None:
            # No renewals on the wall clock: the model decides when time passes.
            keeper_for(saga.store)._run = lambda: None  # type: ignore[method-assign]
        self.client = Client(
            broker_url=f"{redis_url}/1", redis_url=f"{redis_url}/0", settings=saga.settings
        )
        self.client.app.send_task = self._send_task  # type: ignore[method-assign]
        self._client_call = self.client.store._call
        self.client.store._call = self._client_store_call  # type: ignore[method-assign]

    def _policy(self, transcript: Any, tools: Sequence[Any]) -> ModelTurn:
        return self.hooks.hook_model_call(transcript)  # type: ignore[no-any-return,attr-defined]

    def _call(
        self, script: str, run_id: str, *args: Any, step: int | None = None, extra: str = ""
    ) -> Any:
        delivery = current_delivery()
        if delivery is not None and getattr(delivery, "dead", False):
            raise WorkerCrash("the worker is dead (kill -9): no more writes")
        return super()._call(script, run_id, *args, step=step, extra=extra)

    def _client_store_call(self, script: str, run_id: str, *args: Any, **kwargs: Any) -> Any:
        if self.hooks.lose_reply(script, run_id):
            self._client_call(script, run_id, *args, **kwargs)
            raise mc.StoreUnavailableError(f"saga store unreachable ({script}): reply lost")
        return self._client_call(script, run_id, *args, **kwargs)

    # -- entry points ---------------------------------------------------------------------

    def enqueue(self, label: str) -> str:
        return self.saga.enqueue_run(AGENT, "refund order 7", f"{label}-{uuid.uuid4().hex[:10]}")

    def enqueue_again(self, run_id: str, via: str) -> None:
        if via == "client":
            self.client.enqueue_run(AGENT, "refund order 7", run_id)
        else:
            self.saga.enqueue_run(AGENT, "refund order 7", run_id)

    def abort_run(self, run_id: str) -> None:
        self.client.abort_run(run_id, "the user gave up")

    def decide(self, run_id: str, marker: str, verdict: str, hash_: str) -> bool | None:
        """False for a repeat of the decision taken (True: taken now; None: old code)."""
        if verdict == "approved":
            return self.client.approve(run_id, marker, args_hash=hash_, by="checker")
        return self.client.deny(run_id, marker, "not today", args_hash=hash_, by="checker")

    def deliver(self, name: str, kwargs: dict[str, Any], task: Any) -> Any:
        if name == AGENT_TURN_TASK:
            return self.deliver_turn(kwargs, task)
        return super().deliver(name, kwargs, task)

    def deliver_turn(self, kwargs: dict[str, Any], task: Any) -> None:
        """What ``saga.agent_turn`` does with its message (old code: ``run_turn``, a delay)."""
        run_id, turn = str(kwargs["run_id"]), int(kwargs["turn"])
        attempt = int(kwargs.get("attempt", 1))
        play = getattr(hosted_module, "play_turn", None)
        if play is None:  # old code
            tried = task.request.retries + 1
            delay = hosted_module.run_turn(self.saga, run_id, turn, attempt=tried)  # type: ignore[call-arg]
            if delay is not None:
                raise task.retry(countdown=delay)
            return
        # Before the core moved below the facade, a turn took the ``Saga`` alone.
        core = getattr(self.saga, "core", None)
        again = (
            play(core, self.saga.agents, run_id, turn, attempt=attempt)
            if core
            else play(self.saga, run_id, turn, attempt=attempt)
        )
        if again is not None:
            attempt = attempt + 1 if again.model_attempt else attempt
            new = {"run_id": run_id, "turn": turn, "attempt": attempt}
            raise task.retry(countdown=again.delay, kwargs=new)

    def lease_ran_out(self, info: MessageInfo, alive: frozenset[str] = frozenset()) -> None:
        """A turn comes back after the visibility timeout: longer than an asking lease."""
        if info.kind == "turn":
            self.lease_time_passes()
            return
        super().lease_ran_out(info, alive)

    def start_unwind(self, kwargs: dict[str, Any]) -> None:
        """What ``saga.start_unwind`` (sent by ``abort_run``) does with its message."""
        run_id, owner = str(kwargs["run_id"]), str(kwargs.get("owner", ""))
        picture = self.saga.store.picture(run_id)
        if picture is None or picture.state.value != "unwinding":
            return
        if picture.extra.get("owner") == owner and picture.extra.get("sent") == "0":
            self.core.start_unwind(run_id, owner)

    @staticmethod
    def describe(name: str, kwargs: dict[str, Any]) -> MessageInfo:
        run_id = str(kwargs.get("run_id", ""))
        if name == AGENT_TURN_TASK:
            return MessageInfo(run_id, "turn", int(kwargs["turn"]), "")
        if name == START_UNWIND_TASK:
            return MessageInfo(run_id, "start_unwind", None, "")
        return mc.Engine.describe(name, kwargs)

    # -- time ---------------------------------------------------------------------------------

    def lease_time_passes(self) -> None:
        """Longer than an asking lease passes: the keeper (if the code has one) renews the
        leases of model calls still running in this process; every other lease runs out."""
        live: set[str] = set()
        if keeper_for is not None:
            keeper = keeper_for(self.saga.store)
            with contextlib.suppress(SagaError):
                keeper.renew_all()
            live = {hold.token for hold in list(keeper._by_id.values())}
        client = self.saga.store.client
        for key in list(client.scan_iter(match="saga:*:asking:*")):
            if client.get(key) not in live:
                client.delete(key)

    def approvals_age(self, run_ids: list[str], seconds: float) -> list[str]:
        """``seconds`` pass on the Redis clock for the approval requests (the model cannot
        move the clock: it moves the requests back). Returns the runs with a request nobody
        decided nor refused yet."""
        client = self.saga.store.client
        waiting = []
        for run_id in run_ids:
            key = agent_key(run_id)
            loop = client.hgetall(key)
            for name, value in loop.items():
                if name.endswith(":approval"):
                    marker = name.rsplit(":", 1)[0]
                    if f"{marker}:decision" not in loop and f"{marker}:refused" not in loop:
                        waiting.append(run_id)
                    request = json.loads(value)
                    request["requested_at"] = float(request["requested_at"]) - seconds
                    client.hset(key, name, json.dumps(request))
        return waiting

    # -- what the model reads -----------------------------------------------------------------

    def loop(self, run_id: str) -> dict[str, str]:
        return dict(self.saga.store.client.hgetall(agent_key(run_id)))

    def loop_ended(self, run_id: str) -> str:
        return str(self.saga.store.client.hget(agent_key(run_id), "ended") or "")

    def answered(self, run_id: str, turn: int) -> bool:
        return bool(self.saga.store.client.hexists(agent_key(run_id), f"{turn}:answer"))

    def step_calls(self, run_id: str) -> list[tuple[int, str, str, dict[str, Any]]]:
        """(step, call marker, tool, arguments) of the run's steps made by turns."""
        picture = self._real_picture(run_id)
        if picture is None:
            return []
        return [(s.step, s.call, s.tool, dict(s.args or {})) for s in picture.steps if s.call]


# =============================================================================================
# The machine.
# =============================================================================================

#: Faults that excuse the reaper's abandoning a run: a message lost for good, a caller that
#: saw an error, a turn task that failed (acked: only a revival brings it back), or the run
#: had work waiting (queued, unacked, or a model call running) when a pass past its deadline
#: looked at it (slow workers and slow models are the revival limit's to judge).
EXCUSES = (*mc.LOSSES, "lost-reply", "turn-failed", "work-waiting", "db-refused")


@dataclasses.dataclass
class Ask:
    """One model call: who made it, and how it ended."""

    run_id: str
    turn: int
    delivery: int
    outcome: str = "running"  # running | answered | crashed | failed


#: What the model answers turn by turn, unless a rule says otherwise (approvals often: an
#: unanswered one per turn is how the revival limit shows).
SCRIPTS = st.lists(
    st.one_of(st.just("mail"), st.sampled_from(list(ANSWERS))), min_size=0, max_size=6
)


#: What a rule makes the model answer: half the time the script's answer or a call needing
#: approval (so people have requests to decide), else any kind.
ANSWER_KINDS = st.one_of(st.sampled_from(["scripted", "mail"]), st.sampled_from(list(ANSWERS)))


class HostedCheck(ModelCheck):
    """Hosted runs: turns on the broker, a scripted model, people deciding approvals."""

    engine_class = HostedEngine

    def __init__(self) -> None:
        super().__init__()
        self.asks: list[Ask] = []
        #: The fault point of a turn armed to kill the next delivery that reaches it.
        self.armed = ""
        self.aborted: set[str] = set()
        self.script: list[str] = []
        #: The script whose next reply is lost ('' for none).
        self.script_to_lose = ""
        #: At the end of an example: the last reaper pass's offset, and that the end is on.
        self.quiescing = False
        self.clock = 0.0
        #: Runs whose loop ended on a final answer while they were running (seen after a step).
        self.finished: set[str] = set()
        self.engine: HostedEngine

    def world_holds(self) -> None:
        super().world_holds()
        for run_id in self.runs:
            if (
                run_id not in self.finished
                and self.engine.loop_ended(run_id) == "final answer"
                and self.engine.redis_state(run_id) == "running"
            ):
                self.finished.add(run_id)

    # -- hooks ------------------------------------------------------------------------------

    def hook_strike(self, point: str) -> None:
        delivery = current_delivery()
        if delivery is None or delivery.message.info.kind != "turn" or point != self.armed:
            return
        self.armed = ""
        delivery.dead = True  # type: ignore[attr-defined]
        self.touch(delivery.message.info.run_id, f"turn-crash:{point}")
        raise WorkerCrash(f"the turn worker was killed at {point}")

    def hook_publish(self, published: Published) -> None:
        delivery = current_delivery()
        if delivery is not None and getattr(delivery, "dead", False):
            raise WorkerCrash("the worker is dead (kill -9): it publishes nothing")
        super().hook_publish(published)

    def hook_model_call(self, transcript: Any) -> ModelTurn:
        """The scripted model: log the call, check who else asks, wait for the model's word."""
        delivery = current_delivery()
        assert delivery is not None, "the policy runs in a turn delivery"
        run_id = delivery.message.info.run_id
        turn = int(delivery.message.published.kwargs["turn"])
        ask = Ask(run_id, turn, delivery.number)
        with WORLD.lock:
            others = [
                a for a in self.asks if (a.run_id, a.turn, a.outcome) == (run_id, turn, "running")
            ]
            self.asks.append(ask)
        for other in others:
            WORLD.findings.append(
                Finding(
                    "model-asked-concurrently",
                    run_id,
                    f"turn {turn}: deliveries d{other.delivery} and d{delivery.number} are in "
                    "the model at once",
                )
            )
        if self.engine.answered(run_id, turn):
            WORLD.findings.append(
                Finding(
                    "model-asked-after-answer",
                    run_id,
                    f"turn {turn}: d{delivery.number} asks the model, its answer is recorded",
                )
            )
        self.check_fed_back(run_id, turn, transcript)
        delivery.asking = True  # type: ignore[attr-defined]
        command = delivery.gate()
        scripted = self.script[turn - 1] if turn <= len(self.script) else "final"
        kind = getattr(delivery, "answer", scripted)
        if command is Command.CRASH_BEFORE:
            ask.outcome = "crashed"
            delivery.dead = True  # type: ignore[attr-defined]
            raise WorkerCrash("the turn worker was killed in the model call")
        if command is Command.FAIL:
            ask.outcome = "failed"
            raise retryable_model_error()
        ask.outcome = "answered"
        return model_answer(kind, turn)

    def check_fed_back(self, run_id: str, turn: int, transcript: Any) -> None:
        """Every call of an earlier turn refused in Redis (refused, denied, expired, malformed)
        is an error result in the transcript the model reads now."""
        loop = self.engine.loop(run_id)
        results: dict[int, list[Any]] = {}
        k = 0
        for entry in transcript.entries:
            if isinstance(entry, ModelTurn):
                k += 1
            elif hasattr(entry, "results"):
                results[k] = list(entry.results)
        for name, message in loop.items():
            parts = name.split(":")
            if len(parts) != 3 or parts[2] != "refused":
                continue
            k, i = int(parts[0]), int(parts[1])
            if k >= turn:
                continue
            given = results.get(k, [])
            if i >= len(given) or not given[i].is_error:
                WORLD.findings.append(
                    Finding(
                        "refusal-not-fed-back",
                        run_id,
                        f"call {k}:{i} was refused ({message[:80]}), the model reading turn "
                        f"{turn} is not told",
                    )
                )

    # -- helpers ----------------------------------------------------------------------------

    def blocked(self) -> list[Delivery]:
        """Deliveries blocked in a tool (not in the model)."""
        return [
            d for d in self.deliveries if d.phase == "blocked" and d.message.info.kind != "turn"
        ]

    def asking(self) -> list[Delivery]:
        """Turn deliveries blocked in the model call."""
        return [
            d for d in self.deliveries if d.phase == "blocked" and d.message.info.kind == "turn"
        ]

    def start(self, message: Message) -> Delivery | None:
        info = message.info
        if info.kind == "start_unwind":
            try:
                self.engine.start_unwind(message.published.kwargs)
            except Exception as exc:
                self.say(f"{message.label()}: {type(exc).__name__}")
                self.unexpected("start_unwind", info.run_id, exc)
            return None
        if info.kind != "turn":
            return super().start(message)
        task = TurnTask(self.engine.app, message, self)
        return self.run_delivery(message, task, "turn", "the model is asked")

    def finish(self, delivery: Delivery, ack_lost: bool = False) -> None:
        message = delivery.message
        if message.info.kind == "turn" and delivery.outcome == "failed":
            exc = delivery.exc
            assert exc is not None
            with contextlib.suppress(ValueError):
                self.deliveries.remove(delivery)
            self.say(f"{message.label()} d{delivery.number} failed: {type(exc).__name__}")
            # Celery acks a failed task: only a revival helps. A refused publish of the next
            # turn fails the turn too (the hosted loop documents that the reaper sends it).
            if isinstance(exc, SagaError | BrokerError):
                self.touch(message.info.run_id, "turn-failed")
            else:
                self.violation(
                    f"exception:turn:{mc.qualified(exc)}",
                    message.info.run_id,
                    f"{message.label()} raised {mc.qualified(exc)}: {first_line(exc)}",
                )
            return
        super().finish(delivery, ack_lost)

    @precondition(lambda self: bool(self.ready))
    @rule()
    @step
    def settle(self) -> None:
        """Deliver every queued message in order, each to its end (tools proceed, the model
        answers as scripted); a turn waiting for another delivery's model call stays queued
        (``start_delivery`` leaves a model call running)."""
        for _ in range(60):
            with self.broker_lock:
                if not self.ready:
                    return
                message = self.ready[0]
                asked = {(a.run_id, a.turn) for a in self.asks if a.outcome == "running"}
                info = message.info
                if info.kind == "turn" and (info.run_id, info.step) in asked:
                    return
                self.ready.pop(0)
            self.deliver_fully(message)

    def deliver_fully(self, message: Message) -> None:
        """To its end: a tool proceeds, the model answers as the example's script says."""
        delivery = self.start(message)
        if delivery is not None:
            self.order(delivery, Command.PROCEED)

    def unexpected(self, entry: str, run_id: str, exc: BaseException) -> None:
        """A web client's call may see the broker's error (the run's writes are done; the
        message is what failed): the caller calls again, or the reaper moves the run on."""
        if entry in ("enqueue_run", "abort_run", "decide") and isinstance(exc, BrokerError):
            self.touch(run_id, "publish-refused-client")
            return
        super().unexpected(entry, run_id, exc)

    def drain(self, budget: int = 400) -> None:
        """The engine check's drain; a turn that keeps coming back (waiting for the asking
        lease) waits longer than the lease of a dead asker in all."""
        with self.broker_lock:
            waiting = any(m.info.kind == "turn" and m.retries for m in self.ready)
        if waiting:
            self.engine.lease_time_passes()
        super().drain(budget)

    def pop(self, queue: list[Message], pick: int) -> Message:
        message = super().pop(queue, pick)
        if message.info.kind == "turn" and message.retries >= 5:
            self.engine.lease_time_passes()  # retried for longer than a lease by now
        return message

    # -- rules: runs --------------------------------------------------------------------------

    @initialize(count=st.integers(1, 2), undo_failures=st.integers(0, 1), script=SCRIPTS)
    @step
    def start_runs(self, count: int, undo_failures: int, script: list[str]) -> None:
        """``count`` hosted runs (turn 1 of each is on the broker); ``script``: what the model
        answers turn by turn when no rule says otherwise (then: a final answer)."""
        WORLD.undo_failures = undo_failures
        self.script = list(script)
        self.runs = [self.engine.enqueue(f"run{i}") for i in range(count)]
        for run_id in self.runs:
            self.touches[run_id] = []

    @precondition(lambda self: bool(self.runs))
    @rule(run=mc.RUN, via=st.sampled_from(["saga", "client"]))
    @step
    def enqueue_again(self, run: int, via: str) -> None:
        """``enqueue_run`` with the same run id again (a retried HTTP request)."""
        run_id = self.run_id(run)
        self.touch(run_id, "enqueued-again")
        try:
            self.engine.enqueue_again(run_id, via)
        except Exception as exc:
            self.say(f"enqueue again: {type(exc).__name__}: {first_line(exc)}")
            self.unexpected("enqueue_run", run_id, exc)

    @precondition(lambda self: bool(self.in_state("running")))
    @rule(run=mc.RUN)
    @step
    def abort_run(self, run: int) -> None:
        """The user aborts the run (``abort_run``)."""
        running = self.in_state("running")
        run_id = running[run % len(running)]
        self.aborted.add(run_id)
        self.touch(run_id, "abort")
        try:
            self.engine.abort_run(run_id)
        except Exception as exc:
            self.say(f"abort_run: {type(exc).__name__}")
            self.unexpected("abort_run", run_id, exc)

    # -- rules: the model ---------------------------------------------------------------------

    @precondition(lambda self: bool(self.asking()))
    @rule(pick=mc.PICK, kind=ANSWER_KINDS)
    @step
    def answer_model(self, pick: int, kind: str) -> None:
        """The model answers the call it was asked (``kind``: see ``ANSWERS``; ``scripted``:
        what the example's script says for that turn)."""
        asking = self.asking()
        delivery = asking[pick % len(asking)]
        if kind != "scripted":
            delivery.answer = kind  # type: ignore[attr-defined]
        self.say(f"the model answers {kind}")
        self.order(delivery, Command.PROCEED)

    @precondition(lambda self: bool(self.asking()))
    @rule(pick=mc.PICK, how=st.sampled_from(["crash", "rate_limited"]))
    @step
    def model_fails(self, pick: int, how: str) -> None:
        """The worker dies in the model call (kill -9), or the model answers 429."""
        asking = self.asking()
        delivery = asking[pick % len(asking)]
        self.touch(delivery.message.info.run_id, f"model-{how}")
        self.order(delivery, Command.CRASH_BEFORE if how == "crash" else Command.FAIL)

    @rule(script=st.sampled_from(LOOP_SCRIPTS))
    @step
    def lose_reply_of(self, script: str) -> None:
        """The next call of ``script`` runs on the server; its reply is lost on the way back
        (whoever calls it: a turn, a tool worker, the reaper, the web client)."""
        self.script_to_lose = script

    def hook_lose_reply(self, script: str, run_id: str) -> bool:
        if self.script_to_lose and script == self.script_to_lose:
            self.script_to_lose = ""
            side = "worker" if current_delivery() is not None else "client"
            self.touch(run_id, f"lost-reply-{side}:{script}")
            return True
        return super().hook_lose_reply(script, run_id)

    @rule(point=st.sampled_from(TURN_POINTS))
    @step
    def arm_turn_crash(self, point: str) -> None:
        """The next turn delivery that reaches ``point`` of ``run_turn`` is killed there."""
        self.armed = point

    @rule()
    @step
    def lease_time_passes(self) -> None:
        """Longer than an asking lease passes (a model call that outlasts it)."""
        for delivery in self.asking():
            self.touch(delivery.message.info.run_id, "slow-model")
        self.engine.lease_time_passes()

    # -- rules: people --------------------------------------------------------------------------

    def pending(self) -> list[tuple[str, str, dict[str, Any], bool, bool]]:
        """(run, call marker, request, decided, refused) of every approval requested."""
        found = []
        for run_id in self.runs:
            loop = self.engine.loop(run_id)
            for name, value in sorted(loop.items()):
                if name.endswith(":approval"):
                    marker = name.rsplit(":", 1)[0]
                    decided = f"{marker}:decision" in loop
                    refused = f"{marker}:refused" in loop
                    found.append((run_id, marker, json.loads(value), decided, refused))
        return found

    @precondition(lambda self: bool(self.pending()))
    @rule(pick=mc.PICK, how=st.sampled_from(["approve", "deny", "approve_other", "again"]))
    @step
    def decide(self, pick: int, how: str) -> None:
        """A person decides a requested call: approves it as shown, denies it, approves other
        arguments than the request's (refused), or decides one already decided (refused, or
        told it was taken already when it repeats that very decision: nothing changes)."""
        requests = self.pending()
        # Mostly a request still open (of a running run); ``again``: one decided already.
        running = set(self.in_state("running"))
        wanted = [
            r
            for r in requests
            if (r[3] if how == "again" else not r[3] and r[0] in running and not r[4])
        ]
        run_id, marker, request, decided, _ = (wanted or requests)[pick % len(wanted or requests)]
        hash_ = str(request["args_hash"])
        verdict = "denied" if how == "deny" else "approved"
        if how == "approve_other":
            hash_ = args_hash(ToolCall("x", APPROVED_TOOL, {"to": "b@example.com"}))
        try:
            now = self.engine.decide(run_id, marker, verdict, hash_)
        except Exception as exc:
            self.say(f"decide {marker} ({how}): {type(exc).__name__}: {first_line(exc)}")
            self.unexpected("decide", run_id, exc)
            return
        self.say(f"decided {marker}: {how}")
        self.touch(run_id, f"decided-{how}")
        if how == "approve_other":
            self.violation("approval-accepted-other-args", run_id, f"{marker}: accepted")
        if decided and now is not False:
            self.violation("approval-accepted-twice", run_id, f"{marker}: decided twice")

    # -- rules and steps from the engine check that do not apply --------------------------------

    def dispatch(self, *args: Any, **kwargs: Any) -> None:  # the turns dispatch
        raise NotImplementedError

    def dispatch_publish_fails(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def end_run(self, *args: Any, **kwargs: Any) -> None:  # the loop ends its runs
        raise NotImplementedError

    # -- time -------------------------------------------------------------------------------------

    def time_limit_passes(self, offset: float) -> None:
        self.time_moves(offset)
        super().time_limit_passes(offset)

    def time_moves(self, offset: float) -> None:
        if offset < TURN_LEASE:
            return
        waiting = {m.info.run_id for m in self.ready + self.unacked}
        waiting |= {d.message.info.run_id for d in self.deliveries}
        for run_id in waiting:
            self.touch(run_id, "work-waiting")
        self.engine.lease_time_passes()
        if offset >= mc.RUN_DEADLINE:
            for run_id in self.engine.approvals_age(self.runs, offset):
                self.touch(run_id, "approval-unanswered")

    def quiesce_and_check(self) -> None:
        self.quiescing = True
        self.script_to_lose = ""
        super().quiesce_and_check()

    def reap_at(self, offset: float, touch: bool) -> dict[str, list[str]] | None:
        """A reaper pass ``offset`` ahead (the passes at the end of an example too): that
        much time passed for the leases and the approval requests; an abandoned run is
        judged. At the end of an example the clock only moves forward, a deadline and more
        each pass (a run may wait for several approvals to expire, one per pass)."""
        if self.quiescing:
            offset = max(offset, self.clock + mc.RUN_DEADLINE + 1)
            self.clock = offset
        self.time_moves(offset)
        done = super().reap_at(offset, touch)
        if done is not None:
            self.judge_abandoned(done)
        return done

    def reaper_done(self, reaper: Any) -> None:
        super().reaper_done(reaper)
        self.judge_abandoned(reaper.done)

    def judge_abandoned(self, done: dict[str, list[str]]) -> None:
        for run_id, labels in done.items():
            if "reaper-abandoned" not in labels:
                continue
            excused = [t for t in self.touches_of(run_id) if t.startswith(EXCUSES)]
            if not excused:
                self.violation(
                    "abandoned-without-loss",
                    run_id,
                    "the reaper aborted the run as abandoned, though none of its messages was "
                    "lost and nothing of it waited",
                )

    # -- the end of an example --------------------------------------------------------------------

    def check_run(self, run_id: str) -> None:
        super().check_run(run_id)
        state = self.engine.redis_state(run_id)
        loop = self.engine.loop(run_id)
        # The loop ended on the model's final answer while the run was running (not an answer
        # recorded after the run was aborted: the reaper may give up on a slow model call).
        if run_id in self.finished and state != "completed" and run_id not in self.aborted:
            self.violation(
                "final-answer-unwound",
                run_id,
                f"the loop ended on the model's final answer, yet the run ended {state}",
            )
        ended = loop.get("ended", "")
        if ended.startswith("the policy failed"):  # the scripted model never raises so
            self.violation("loop-failed-in-the-library", run_id, f"the loop ended: {ended[:160]}")
        steps = self.engine.step_calls(run_id)
        markers = [marker for _, marker, _, _ in steps]
        for marker in set(markers):
            if markers.count(marker) > 1:
                self.violation("call-two-steps", run_id, f"call {marker} got two steps")
        sent = {e.step for e in WORLD.effects_of(run_id) if e.tool == APPROVED_TOOL}
        for step_number, marker, tool, arguments in steps:
            if step_number not in sent:
                continue
            decision = json.loads(loop.get(f"{marker}:decision") or "{}")
            wanted = args_hash(ToolCall("x", tool, arguments))
            if decision.get("verdict") != "approved" or decision.get("args_hash") != wanted:
                self.violation(
                    "irreversible-without-approval",
                    run_id,
                    f"{tool} of call {marker} went out without an approval of its arguments",
                )


class TurnTask(FakeTask):
    """The bound turn task: ``retry`` sends a copy (same id) with the kwargs given."""

    def __init__(self, app: Any, message: Message, machine: HostedCheck) -> None:
        super().__init__(app, message, machine.requeue_copy)
        self.machine = machine

    def retry(
        self,
        exc: BaseException | None = None,
        countdown: float | None = None,
        kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> Any:
        message = self._message
        published = message.published
        if kwargs is not None:
            published = dataclasses.replace(published, kwargs=dict(kwargs))
        self.machine.enqueue(published, message.info, message.retries + 1)
        from celery.exceptions import Retry

        return Retry(exc=exc, when=countdown)


def main(argv: list[str] | None = None) -> int:
    return mc.main(
        argv,
        HostedCheck,
        "tests.reliability.modelcheck_hosted",
        description=(__doc__ or "").split("\n\n")[0],
    )


if __name__ == "__main__":
    sys.exit(main())
