"""The Celery app and tools of the randomised chaos run (``python -m tests.reliability.chaos``).

Workers run it as ``celery -A tests.reliability.chaos_app worker``. Every tool acts on a
side-effect ledger of its own in Redis (keys ``chaos:*``, on the chaos run's private Redis) and
honours its idempotency key as a real API would: the first call with a key applies the effect
and records an *application*; every later call with that key replays the recorded result. Each
call, replay or not, bumps an *execution* counter (redeliveries show there), and each
application takes a global sequence number, so the order of undos can be checked afterwards.
The checker (``chaos.py``) counts effects in this ledger, never in the saga's own records.

Faults are planned per run: the runner writes ``chaos:plan:<run_id>`` before the run starts,
and the tools act on it themselves at two points of each call, before and after the effect:
raise, SIGKILL their pool process, or SIGKILL the whole worker (the runner restarts it). A
fault named ``fail:<step>`` / ``kill:<step>`` (``cfail``/``ckill`` for the step's compensation)
fires on the calls ``nth`` to ``nth + times - 1`` of that run (counted in
``chaos:fired:<run_id>``), so a "kill once" lets the redelivered message go through.

Hosted runs play the ``chaos`` agent, whose policy (``chaos_policy``) runs in the turn worker
(a threads pool on ``saga.turns``). Its script is the run's input: the plan's steps in 2-4
turns, sometimes with the irreversible call asked for too early (refused, then asked again).
Every call of the policy is counted per (run, turn) in the ledger (``chaos:model:<run>:<turn>``,
INCR; ``chaos:model_log:<run>:<turn>`` lists the pid of the process that made each call), so
the checker can tell a turn asked twice from a turn whose first asker was killed. The plan kills
the turn worker inside the model call (``tkill:<turn>:in_model_call``, by the policy, after it
counted the call: the answer is never recorded, so the turn is asked again), and at the turn
task's fault points (``tkill:<turn>:after_model_answer``, ``tkill:<turn>:between_dispatches``,
by ``TurnFaults``); a step's ``kill`` with ``turn_worker`` SIGKILLs the whole turn worker from
outside, whatever turns it is playing. A long model call (the script's ``long``) thinks past
its asking lease's first length and the visibility timeout, so its turn's message comes back
while it runs; the plan may kill the asker in it once the lease would have run out unrenewed
(``tkill:<turn>:in_long_call``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any

import redis
from celery import Celery, current_task
from redis.exceptions import RedisClusterException

from saga import (
    NonRetryableToolError,
    RetryPolicy,
    Saga,
    StepContext,
    ToolClass,
    ToolRegistry,
    Undo,
)
from saga.agents import ModelTurn, ToolCall, Transcript
from saga.agents.lease import TURN_LEASE_SECONDS
from saga.constants import agent_key
from saga.errors import ModelCallError
from saga.testing import Faults

#: Prefix of every ledger key.
PREFIX = "chaos"
APPLIED = f"{PREFIX}:applied"  # hash: idempotency key -> application record (JSON)
EXECUTIONS = f"{PREFIX}:executions"  # hash: idempotency key -> calls, replays included
SEQUENCE = f"{PREFIX}:seq"  # global order of applications
STATS = f"{PREFIX}:stats"  # hash: what the tools injected (kills, failures)
ANOMALIES = f"{PREFIX}:anomalies"  # list: things no correct caller can make a tool see
#: Set in the workers' environment only: a tool kills its process only where this says so.
WORKER_ENV = "SAGA_CHAOS_WORKER"
#: Where the tools' side-effect ledger lives, when not on the store's Redis.
LEDGER_ENV = "SAGA_CHAOS_LEDGER_URL"

#: Fast policies keep the run short; the visibility timeout (6 s) stays far above them.
FAST = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)
FAST_UNDO = RetryPolicy(attempts=3, backoff=0.1, backoff_max=0.5)


def slot_key(slot: int) -> str:
    return f"{PREFIX}:slot:{slot}"


def tag_key(slot: int) -> str:
    return f"{PREFIX}:tag:{slot}"


def balance_key(account: str) -> str:
    return f"{PREFIX}:balance:{account}"


def charge_key(charge_id: str) -> str:
    return f"{PREFIX}:charge:{charge_id}"


def outbox_key(to: str) -> str:
    return f"{PREFIX}:outbox:{to}"


def plan_key(run_id: str) -> str:
    return f"{PREFIX}:plan:{run_id}"


def fired_key(run_id: str) -> str:
    return f"{PREFIX}:fired:{run_id}"


def model_calls_key(run_id: str, turn: int) -> str:
    """How often the policy was called for ``turn`` of ``run_id`` (INCR, by the policy)."""
    return f"{PREFIX}:model:{run_id}:{turn}"


def model_log_key(run_id: str, turn: int) -> str:
    """One entry per policy call: the pid that made it and the loop's own ``asked`` count."""
    return f"{PREFIX}:model_log:{run_id}:{turn}"


def gave_up_key(run_id: str) -> str:
    return f"{PREFIX}:gave_up:{run_id}"


#: The turn worker's pid, written by the runner each time it starts one.
TURN_WORKER = f"{PREFIX}:turn_worker"
#: Turn worker kills the plans made: "<pid> <run> <fault>".
TURN_KILLS = f"{PREFIX}:turn_kills"


# One script applies any effect, atomically with its idempotency check and its records.
# KEYS: applied, executions, sequence, target, anomalies
# ARGV: idempotency key, kind, meta (JSON: run, step, undo, tool, args), value, cents
_APPLY = """
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local done = redis.call('HGET', KEYS[1], ARGV[1])
if done then return done end
local kind, value = ARGV[2], ARGV[4]
local meta = cjson.decode(ARGV[3])
local result
if kind == 'refund' then
  -- A payments API refuses to refund a charge it never made (or one refunded already).
  local charge = KEYS[4]
  if redis.call('EXISTS', charge) == 0 then
    redis.call('RPUSH', KEYS[5], 'refund of unknown charge ' .. value .. ' by ' .. ARGV[1])
    return redis.error_reply('unknown charge ' .. value)
  end
  local refunds = redis.call('HINCRBY', charge, 'refunds', 1)
  if refunds > 1 then
    redis.call('RPUSH', KEYS[5], 'charge ' .. value .. ' refunded again by ' .. ARGV[1])
  end
  local account = redis.call('HGET', charge, 'account')
  redis.call('DECRBY', ARGV[6] .. account, redis.call('HGET', charge, 'cents'))
end
local seq = redis.call('INCR', KEYS[3])
if kind == 'put' then
  local previous = redis.call('GET', KEYS[4])
  if not previous then previous = '' end
  redis.call('SET', KEYS[4], value)
  result = {slot = meta.args.slot, previous = previous}
elseif kind == 'tag' then
  redis.call('SET', KEYS[4], value)
  result = {slot = meta.args.slot, value = value}
elseif kind == 'charge' then
  local id = 'ch-' .. seq
  redis.call('INCRBY', KEYS[4], ARGV[5])
  redis.call('HSET', ARGV[6] .. id, 'account', meta.args.account, 'cents', ARGV[5],
    'key', ARGV[1], 'refunds', 0)
  result = {charge_id = id}
elseif kind == 'refund' then
  result = {refund_id = 'rf-' .. seq, charge_id = value}
elseif kind == 'notify' then
  redis.call('RPUSH', KEYS[4], ARGV[1])
  result = {message_id = 'msg-' .. seq, to = meta.args.to}
else
  return redis.error_reply('unknown kind ' .. kind)
end
meta.seq = seq
meta.result = result
local record = cjson.encode(meta)
redis.call('HSET', KEYS[1], ARGV[1], record)
return record
"""


class Ledger:
    """The chaos run's world: slots, tags, accounts, an outbox, and who applied what."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self._apply = self.client.register_script(_APPLY)

    def apply(
        self, ctx: StepContext, tool: str, kind: str, args: dict[str, Any], target: str, **kw: Any
    ) -> dict[str, Any]:
        meta = {
            "run": ctx.run_id,
            "step": ctx.step,
            "undo": ctx.compensating,
            "tool": tool,
            "args": args,
        }
        raw = self._apply(
            keys=[APPLIED, EXECUTIONS, SEQUENCE, target, ANOMALIES],
            args=[
                ctx.idempotency_key,
                kind,
                json.dumps(meta),
                str(kw.get("value", "")),
                str(kw.get("cents", 0)),
                f"{PREFIX}:balance:" if kind == "refund" else f"{PREFIX}:charge:",
            ],
        )
        return dict(json.loads(raw)["result"])

    def executed(self, ctx: StepContext) -> None:
        self.client.hincrby(EXECUTIONS, ctx.idempotency_key, 1)

    def application(self, idempotency_key: str) -> dict[str, Any] | None:
        raw = self.client.hget(APPLIED, idempotency_key)
        return None if raw is None else dict(json.loads(raw))

    def strike(self, ctx: StepContext, point: str) -> None:
        """Act on this run's fault plan at ``point`` ("before" or "after" the effect)."""
        prefix = "c" if ctx.compensating else ""
        wanted = [f"{prefix}{kind}:{ctx.step}" for kind in ("fail", "kill")]
        specs = self.client.hmget(plan_key(ctx.run_id), wanted)
        for name, raw in zip(wanted, specs, strict=True):
            if raw is None:
                continue
            spec = json.loads(raw)
            if spec["point"] != point:
                continue
            fired = self.client.hincrby(fired_key(ctx.run_id), name, 1)
            first = int(spec.get("nth", 1))  # fires on calls nth .. nth + times - 1
            if not first <= fired < first + int(spec["times"]):
                continue
            where = f"{name} {point} the effect of {ctx.idempotency_key} (#{fired})"
            if name.startswith(("fail", "cfail")):
                self.client.hincrby(STATS, "undo_failures" if prefix else "failures", 1)
                if spec.get("final"):
                    raise NonRetryableToolError(f"chaos: refused at {where}")
                raise ChaosFault(f"chaos: failed at {where}")
            if os.environ.get(WORKER_ENV) != "1":  # never kill a process that is not a worker
                raise ChaosFault(f"chaos: would have killed at {where}")
            if spec.get("turn_worker"):  # the turn worker dies; this tool goes on
                self.kill_turn_worker(ctx.run_id, name)
                continue
            if spec.get("whole_worker"):
                self.client.hincrby(STATS, "kills_worker", 1)
                os.killpg(os.getpgid(0), signal.SIGKILL)
            self.client.hincrby(STATS, "kills_child", 1)
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_turn_worker(self, run_id: str, fault: str) -> None:
        """SIGKILL the turn worker (its whole process group) from outside."""
        pid = int(self.client.get(TURN_WORKER) or 0)
        if pid <= 0:
            return
        self.client.hincrby(STATS, "kills_turn", 1)
        self.client.rpush(TURN_KILLS, f"{pid} {run_id} {fault}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def strike_turn(self, run_id: str, turn: int, point: str) -> None:
        """In the turn worker: kill it if the plan says so at ``point`` of ``turn``."""
        name = f"tkill:{turn}:{point}"
        raw = self.client.hget(plan_key(run_id), name)
        if raw is None or os.environ.get(WORKER_ENV) != "1":
            return
        spec = json.loads(raw)
        fired = self.client.hincrby(fired_key(run_id), name, 1)
        first = int(spec.get("nth", 1))
        if not first <= fired < first + int(spec["times"]):
            return
        self.client.hincrby(STATS, "kills_turn", 1)
        self.client.rpush(TURN_KILLS, f"{os.getpid()} {run_id} {name}#{fired}")
        os.kill(os.getpid(), signal.SIGKILL)  # a threads pool: the whole turn worker


class ChaosFault(Exception):
    """A retryable failure the plan injected (an ordinary exception: the saga retries it)."""


_ledger: Ledger | None = None


def configure(url: str) -> Ledger:
    """Point the tools (and lookups run in this process, by the reaper) at ``url``."""
    global _ledger
    _ledger = Ledger(url)
    return _ledger


def ledger() -> Ledger:
    if _ledger is None:
        # The tools' own world: on the store's Redis, or (a store that fails over) on a Redis
        # of its own, as a real tool's systems are not the saga's.
        url = os.environ.get(LEDGER_ENV) or os.environ.get("SAGA_REDIS_URL")
        if not url:
            raise RuntimeError(f"the chaos ledger needs {LEDGER_ENV} or SAGA_REDIS_URL")
        return configure(url)
    return _ledger


def _lookup(idempotency_key: str, _args: dict[str, Any]) -> Any:
    """Find a step's effect by its key, as a real API's "get by idempotency key" would."""
    record = ledger().application(idempotency_key)
    return None if record is None else record["result"]


def _apply(
    ctx: StepContext, tool: str, kind: str, args: dict[str, Any], target: str, **kw: Any
) -> dict[str, Any]:
    book = ledger()
    book.strike(ctx, "before")
    result = book.apply(ctx, tool, kind, args, target, **kw)
    book.strike(ctx, "after")
    return result


tools = ToolRegistry()


@tools.tool(ToolClass.READ, retry=FAST)
def peek(ctx: StepContext, slot: int) -> dict[str, Any]:
    """Read a slot (class 1: no effect, nothing to undo)."""
    book = ledger()
    book.strike(ctx, "before")
    book.executed(ctx)
    value = book.client.get(slot_key(slot))
    book.strike(ctx, "after")
    return {"slot": slot, "value": value or ""}


@tools.tool(ToolClass.CONVERGENT_WRITE, retry=FAST, lookup=_lookup)
def tag(ctx: StepContext, slot: int, value: str) -> dict[str, Any]:
    """Set a tag to a desired value (class 2: converges on retry, kept on unwind)."""
    args = {"slot": slot, "value": value}
    return _apply(ctx, "tag", "tag", args, tag_key(slot), value=value)


def _restore(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo(
        "put",
        {"slot": result["slot"], "value": result["previous"]},
        f"put slot {result['slot']} back to {result['previous']!r}",
    )


@tools.tool(ToolClass.REVERSIBLE_WRITE, compensation=_restore, retry=FAST, lookup=_lookup)
def put(ctx: StepContext, slot: int, value: str) -> dict[str, Any]:
    """Overwrite a slot (class 3: undone by putting the captured previous value back)."""
    args = {"slot": slot, "value": value}
    return _apply(ctx, "put", "put", args, slot_key(slot), value=value)


def _refund(args: dict[str, Any], result: dict[str, Any]) -> Undo:
    return Undo(
        "refund",
        {"charge_id": result["charge_id"]},
        f"refund {result['charge_id']} ({args['cents']} cents to {args['account']})",
    )


#: A charge this large is a costly reversal: its refund asks a person first (the chaos run's
#: operator answers, or lets the question expire).
COSTLY_CENTS = 8000


def _costly(args: dict[str, Any], result: Any) -> bool:
    return int(args["cents"]) >= COSTLY_CENTS


@tools.tool(
    ToolClass.COMPENSATABLE_WRITE,
    compensation=_refund,
    retry=FAST,
    lookup=_lookup,
    reversal=_costly,
)
def charge(ctx: StepContext, account: str, cents: int) -> dict[str, Any]:
    """Charge an account (class 4: undone by a visible refund of the captured charge id)."""
    args = {"account": account, "cents": cents}
    return _apply(ctx, "charge", "charge", args, balance_key(account), cents=cents)


@tools.compensation(retry=FAST_UNDO)
def refund(ctx: StepContext, charge_id: str) -> dict[str, Any]:
    """Refund a charge, once per idempotency key; an unknown charge is refused for good."""
    try:
        return _apply(
            ctx,
            "refund",
            "refund",
            {"charge_id": charge_id},
            charge_key(charge_id),
            value=charge_id,
        )
    except redis.ResponseError as exc:
        raise NonRetryableToolError(f"refund refused: {exc}") from exc


@tools.tool(ToolClass.IRREVERSIBLE_WRITE, retry=FAST, lookup=_lookup)
def notify(ctx: StepContext, to: str) -> dict[str, Any]:
    """Send a message (class 5: once sent it is gone; the pivot)."""
    return _apply(ctx, "notify", "notify", {"to": to}, outbox_key(to))


app = Celery("saga-chaos")
app.config_from_object("celeryconfig")
# A message stranded by a whole-worker kill comes back at the first sweep for unacknowledged
# messages past the visibility timeout: sweep every second (kombu's own default is every 100 s),
# and let a sweep lock left behind by a killed worker expire in 10 s (kombu: 300 s).
app.conf.broker_transport_options = {
    **app.conf.broker_transport_options,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 10,
}

saga = Saga(app, tools)


# -- the hosted agent --------------------------------------------------------------------------

AGENT = "chaos"
HOSTED_TOOLS = ["peek", "tag", "put", "charge", "notify"]
#: The turn task's own fault points that the plans use (``saga.testing.FAULT_POINTS``).
TURN_POINTS = ("after_model_answer", "between_dispatches")


def script_turns(script: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The calls the policy asks for, turn by turn: each ``{"tool", "args", "step"}``, where
    ``step`` is the step number the call must get (None: the irreversible call asked for too
    early, which must be refused). The checker rebuilds the answers from this too."""
    turns = [[dict(call) for call in group] for group in script["turns"]]
    early = script.get("early")
    if early:
        notify = next(c for group in turns for c in group if c["tool"] == "notify")
        turns[early["turn"] - 1].insert(early["at"], {**notify, "step": None})
    return turns


def _current_turn() -> tuple[str, int] | None:
    """The (run, turn) of the turn task this thread is running, if any."""
    request = getattr(current_task, "request", None)
    kwargs = getattr(request, "kwargs", None) or {}
    if "run_id" not in kwargs or "turn" not in kwargs:
        return None
    return str(kwargs["run_id"]), int(kwargs["turn"])


def chaos_policy(transcript: Transcript, tools: Any) -> ModelTurn:
    """The scripted model of hosted chaos runs: plays the run's script (its input), counting
    each of its calls first; gives up (a fatal model error: the run aborts) where the script
    says so, or on any error result it did not expect."""
    script = json.loads(transcript.entries[0].text)  # type: ignore[union-attr]
    run_id, index = str(script["run"]), len(transcript.turns)
    turn = index + 1
    book = ledger()
    asked = _loop_asked(run_id, turn)
    with book.client.pipeline(transaction=True) as pipe:
        pipe.incr(model_calls_key(run_id, turn))
        pipe.rpush(model_log_key(run_id, turn), f"{os.getpid()} {asked or 0}")
        calls = int(pipe.execute()[0])
    playing = _current_turn()
    if playing is not None and playing != (run_id, turn):
        book.client.rpush(ANOMALIES, f"policy asked for {run_id} turn {turn} in {playing}")
    book.strike_turn(run_id, turn, "in_model_call")
    time.sleep(float(script.get("think", 0)))  # a model takes a moment
    long = script.get("long") or {}
    if long.get("turn") == turn:
        # A call that outlasts its lease's first length: without renewals another delivery
        # could ask now. The plan may kill the asker here, once that length has passed.
        seconds = float(long["seconds"])
        lease = min(saga.core.lease_seconds, TURN_LEASE_SECONDS)  # as the turn took it
        past_lease = min(seconds, lease + 1.0)
        time.sleep(past_lease)
        book.strike_turn(run_id, turn, "in_long_call")
        time.sleep(seconds - past_lease)
    turns = script_turns(script)
    expected = {c["tool"] for c in turns[index - 1] if c["step"] is None} if index else set()
    last = transcript.last_turn
    for call, result in zip(last.calls if last else (), transcript.last_results, strict=False):
        if result.is_error and call.name not in expected:
            _give_up(book, run_id, turn, f"{call.name} came back with an error: {result.content}")
        if not result.is_error and call.name in expected:
            book.client.rpush(ANOMALIES, f"{run_id} turn {index}: early {call.name} was run")
    if script.get("give_up") == turn:
        _give_up(book, run_id, turn, "the model changed its mind")
    if index == len(turns):
        return ModelTurn(text="done", raw={"turn": turn, "call": calls})
    if index > len(turns):
        book.client.rpush(ANOMALIES, f"{run_id}: turn {turn} asked, the script has {index}")
        _give_up(book, run_id, turn, "asked past the script's end")
    return ModelTurn(
        calls=tuple(
            ToolCall(f"call_{turn}_{i}", c["tool"], dict(c["args"]))
            for i, c in enumerate(turns[index])
        ),
        raw={"turn": turn, "call": calls},
        stop_reason="tool_use",
    )


def _loop_asked(run_id: str, turn: int) -> str | None:
    """The loop's own count of asks of ``turn``, from the saga's store (not the ledger's
    Redis, when the two differ), read again through a failover (a cluster's too: its client
    says it could reach no node with a ``RedisClusterException``, no ``RedisError``)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            value = saga.store.client.hget(agent_key(run_id), f"{turn}:asked")
            return None if value is None else str(value)
        except (redis.RedisError, RedisClusterException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _give_up(book: Ledger, run_id: str, turn: int, why: str) -> None:
    book.client.hsetnx(gave_up_key(run_id), str(turn), why)
    raise ModelCallError(f"chaos: the model gives up at turn {turn}: {why}")


class TurnFaults(Faults):
    """The turn task's fault points, acting on the run's plan (not on ``Faults`` rules)."""

    def __init__(self) -> None:  # no rules in Redis: each run's plan says where to kill
        pass

    def strike(self, point: str, tool: str) -> None:
        playing = _current_turn() if point in TURN_POINTS else None
        if playing is not None:
            ledger().strike_turn(playing[0], playing[1], point)


saga.agent(AGENT, chaos_policy, tools=HOSTED_TOOLS)
if os.environ.get(WORKER_ENV) == "1":
    saga.faults = TurnFaults()
